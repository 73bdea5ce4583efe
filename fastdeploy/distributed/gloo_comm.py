"""Collectives between tensor-parallel ranks on several hosts: Paddle's gloo process group.

Rank 0 holds the group's TCPStore at PADDLE_MASTER (distributed/launch.py); every rank meets there, checks that
it was started with the same engine arguments as rank 0, loads its shard, and then joins one gloo group. gloo's
all-reduce is a ring (each element summed once, on one rank, then passed on), so every rank holds the same bits;
steps reach the ranks as frames broadcast from rank 0 (worker/step_codec.py encodes them).

Failure bounds (docs/distributed.md): a rank whose process exits closes its connections, and a collective
waiting for it fails at once; a rank that stops answering (hung, or its host gone) fails it after gloo's
30 s timeout. Idle workers would hit that timeout waiting for the next step, so rank 0 broadcasts an empty
frame when nothing else went out for HEARTBEAT_S; and a worker's pending receive may miss that rank 0 was
killed, so workers also watch how long they wait (both in worker/launched_group.py).
"""
from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import paddle

from fastdeploy.distributed.launch import Launch

STORE_TIMEOUT_S = 300  # every rank must reach the store within this long of rank 0
LOAD_TIMEOUT_S = 3600.0  # every rank must have loaded its shard within this long of the first
GLOO_TIMEOUT_S = 30.0  # gloo's own, fixed: a collective some rank never joins fails after this long
HEARTBEAT_S = 5.0
FRAME_BYTES = 4096  # a step message up to this size is one broadcast; a larger one, two
MAX_MESSAGE_BYTES = 1 << 30  # a step's media included; a frame announcing more is refused, not allocated
_POLL_S = 0.05


class RankLost(RuntimeError):
    """A collective failed: some rank exited, stopped answering, or the network between them broke."""


def _run(task_maker: Callable[[], Any], what: str) -> None:
    try:
        task_maker().wait()
    except RuntimeError as e:
        raise RankLost(f"tensor-parallel {what} failed: another rank exited, or did not answer for "
                       f"{GLOO_TIMEOUT_S:g} s (gloo: {str(e).splitlines()[0][:200]})") from e


class Rendezvous:
    """The store every rank meets at: config check, the loaded barrier, then the gloo group."""

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
                           f"{launch.master_host}:{launch.master_port} (PADDLE_MASTER) within {STORE_TIMEOUT_S} s: "
                           f"start the launcher on every node, with the same --master or --ips ({e})") from e
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

    def process_group(self):
        """The ranks' gloo group (every rank calls this at the same point: it is a collective)."""
        from paddle.base import core

        # Paddle's group reads its global rank from the launcher's variable; under ips= there is no launcher.
        had = os.environ.get("PADDLE_TRAINER_ID")  # env-ok: handed to Paddle, not read as a switch
        os.environ["PADDLE_TRAINER_ID"] = str(self.launch.rank)
        try:
            return core.ProcessGroupGloo.create(self.store, self.launch.rank, self.launch.world_size, 0)
        except RuntimeError as e:
            raise RankLost(f"the gloo group did not form ({e}); set GLOO_SOCKET_IFNAME to the interface of the "
                           "address the other nodes reach this one by") from e
        finally:
            if had is None:
                del os.environ["PADDLE_TRAINER_ID"]
            else:
                os.environ["PADDLE_TRAINER_ID"] = had


def _wait_for_master(launch: Launch) -> None:
    """Paddle's store client retries forever; see first that the master's port answers, within the bound."""
    deadline = time.monotonic() + STORE_TIMEOUT_S
    while True:
        try:
            socket.create_connection((launch.master_host, launch.master_port), timeout=2.0).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RankLost(f"rank {launch.rank} could not reach the master {launch.master_host}:"
                               f"{launch.master_port} (PADDLE_MASTER) within {STORE_TIMEOUT_S} s ({e}): check the "
                               "launcher's --master / --ips address and that this port is open between the hosts"
                               ) from e
            time.sleep(0.5)


class GlooComm:
    """One rank's collectives over the gloo group: ring all-reduce, gather to rank 0, rank 0's broadcast."""

    def __init__(self, rank: int, size: int) -> None:
        from paddle.base import core

        self._group, self.rank, self.size = None, rank, size  # the group is attached once every rank has loaded
        self._sum, self._min = core.ReduceOp.SUM, core.ReduceOp.MIN
        self._frame = paddle.zeros([FRAME_BYTES], dtype="uint8")

    @property
    def attached(self) -> bool:
        return self._group is not None

    def attach(self, group) -> None:
        self._group = group

    def gather_to_first(self, x: paddle.Tensor) -> paddle.Tensor:
        """[size, *x.shape]: every rank's x in rank order, on rank 0 (the others get zeros: nobody reads them)."""
        x = x.contiguous()
        out = paddle.zeros([self.size, *x.shape], dtype=x.dtype)
        _run(lambda: self._group.gather(x, out, 0, True), "gather")
        return out

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """The ranks' sum of x; the same bits on every rank (gloo's ring sums each element once)."""
        x = x.clone()
        _run(lambda: self._group.all_reduce(x, self._sum, True), "all-reduce")
        return x

    def min_int(self, value: int) -> int:
        x = paddle.to_tensor(np.asarray([value], np.int64))
        _run(lambda: self._group.all_reduce(x, self._min, True), "all-reduce")
        return int(x.numpy()[0])

    def send(self, message: bytes) -> None:
        """Rank 0: broadcast a message (its first FRAME_BYTES in one frame whose first 4 bytes give its length)."""
        if len(message) > MAX_MESSAGE_BYTES:
            raise ValueError(f"a step message of {len(message)} bytes is over {MAX_MESSAGE_BYTES}: send fewer or "
                             "smaller media per step")
        head = struct.pack("<I", len(message)) + message[:FRAME_BYTES - 4]
        frame = np.zeros(FRAME_BYTES, np.uint8)
        frame[:len(head)] = np.frombuffer(head, np.uint8)
        self._broadcast(paddle.to_tensor(frame))
        rest = message[FRAME_BYTES - 4:]
        if rest:
            self._broadcast(paddle.to_tensor(np.frombuffer(rest, np.uint8)))

    def receive(self) -> bytes:
        """Ranks > 0: the next message rank 0 sends."""
        self._broadcast(self._frame)
        frame = self._frame.numpy().tobytes()
        (n,) = struct.unpack_from("<I", frame)
        if n > MAX_MESSAGE_BYTES:
            raise RankLost(f"rank 0 announced a step message of {n} bytes, more than {MAX_MESSAGE_BYTES}: refused")
        message = frame[4:4 + n]
        if n > FRAME_BYTES - 4:
            rest = paddle.zeros([n - (FRAME_BYTES - 4)], dtype="uint8")
            self._broadcast(rest)
            message += rest.numpy().tobytes()
        return message

    def _broadcast(self, x: paddle.Tensor) -> None:
        _run(lambda: self._group.broadcast(x, 0, True), "broadcast")

