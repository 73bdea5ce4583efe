"""Where the tensor-parallel ranks on several hosts meet: rank 0's store (Paddle's TCPStore).

Rank 0 holds the store at the master address (distributed/launch.py: the launcher's PADDLE_MASTER, or the first
node of `ips` at engine_worker_queue_port); every rank meets there, checks that it was started with the same engine
arguments and checkpoint as rank 0, loads its shard, waits until all have, and then joins the ring of connections
its collectives run over (tcp_ring.py), whose addresses it finds in the store.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping

from fastdeploy.distributed.launch import Launch, answers

STORE_TIMEOUT_S = 300  # every rank must reach the store within this long of rank 0
LOAD_TIMEOUT_S = 3600.0  # every rank must have loaded its shard within this long of the first
_POLL_S = 0.05
_MASTER = "the launcher's --master / --ips, or ips[0] and engine_worker_queue_port"


class RankLost(RuntimeError):
    """A collective failed: some rank exited, stopped answering, or the network between them broke."""


class Rendezvous:
    """The store every rank meets at: config check, the loaded barrier, the ring's addresses."""

    def __init__(self, launch: Launch, fields: Mapping[str, str]) -> None:
        from paddle.base import core

        self.launch = launch
        if launch.rank:
            _wait_for_master(launch)
        else:
            launch.check_rank_zero_here()
        try:
            self.store = core.TCPStore(launch.master_host, launch.master_port, launch.rank == 0, launch.world_size,
                                       STORE_TIMEOUT_S)
        except (RuntimeError, SystemError) as e:
            raise RankLost(f"rank {launch.rank}: the {launch.world_size} ranks did not all reach the store at "
                           f"{launch.master_host}:{launch.master_port} ({_MASTER}) within {STORE_TIMEOUT_S} s: "
                           f"start every node, with the same master ({e})") from e
        self._check_same(fields)

    def _check_same(self, fields: Mapping[str, str]) -> None:
        """ValueError naming the first argument in which this rank differs from rank 0."""
        if self.launch.rank == 0:
            self.store.set("fastdeploy/config", json.dumps(dict(fields)).encode())
            return
        ours, theirs = dict(fields), json.loads(bytes(self.store.get("fastdeploy/config")).decode())
        for name in sorted(set(ours) | set(theirs)):
            if ours.get(name) != theirs.get(name):
                self.fail(f"rank {self.launch.rank} differs from rank 0 in {name}: {ours.get(name)!r} here, "
                          f"{theirs.get(name)!r} on rank 0; start every node with the same arguments and checkpoint")

    def fail(self, message: str) -> None:
        """Tell the other ranks why this one gives up, then raise."""
        self.announce_failure(message)
        raise ValueError(message)

    def announce_failure(self, message: str) -> None:
        """Let the other ranks' barrier end with this rank's reason instead of waiting for it."""
        self.store.set("fastdeploy/failure", f"rank {self.launch.rank}: {message}".encode()[:4000])
        self.store.add("fastdeploy/failed", 1)  # after the message: a rank that sees the count can read it

    def barrier(self, name: str, timeout_s: float) -> None:
        """Wait until every rank got here; a rank that failed (Rendezvous.fail) ends the wait with its message."""
        key = f"fastdeploy/{name}"
        self.store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while self.store.add(key, 0) < self.launch.world_size:
            if self.store.add("fastdeploy/failed", 0):
                raise RankLost(bytes(self.store.get("fastdeploy/failure")).decode(errors="replace"))
            if time.monotonic() > deadline:
                raise RankLost(f"not every tensor-parallel rank reached '{name}' within {timeout_s:g} s")
            time.sleep(_POLL_S)


def _wait_for_master(launch: Launch) -> None:
    """Paddle's store client retries forever; see first that the master's port answers, within the bound."""
    deadline = time.monotonic() + STORE_TIMEOUT_S
    while not answers(launch.master_host, launch.master_port):
        if time.monotonic() > deadline:
            raise RankLost(f"rank {launch.rank} could not reach the master {launch.master_host}:"
                           f"{launch.master_port} ({_MASTER}) within {STORE_TIMEOUT_S} s: check that address and "
                           "that this port is open between the hosts")
        time.sleep(0.5)
