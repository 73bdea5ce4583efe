"""Tensor parallel over ranks on one or several hosts, started by Paddle's launcher or by FastDeploy's `ips=` form.

Every node runs the same script (or server), under `python -m paddle.distributed.launch` or with `ips=`; each
process builds its EngineConfig from its own arguments and finds its rank in the launcher's variables or in `ips`
(config.launch). Under `ips=`, a node's first rank starts the node's other ranks (`start_node_ranks`): children of
this interpreter that read their place and the config from stdin (`main`).
Rank 0 keeps the engine and, through `LaunchedGroup`, broadcasts each step to the other ranks as a binary
message (step_codec.py) round the ranks' ring of connections (distributed/tcp_ring.py). The other ranks never
return from building their engine: `serve_steps` loads their shard, runs every step rank 0 sends, and ends the
process with status 0 when rank 0 stops (its LLM closed or its interpreter exiting), or 1 when the group breaks.

Startup: every rank meets at rank 0's store and proves it has the same engine arguments and checkpoint; each
loads its shard (which needs only its rank and size); all wait until every rank has loaded (LOAD_TIMEOUT_S),
join the ring and take the smallest of the ranks' KV block counts (each sized from its own host's memory).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn, TypeVar

from fastdeploy import ops
from fastdeploy.config import EngineConfig
from fastdeploy.distributed.parallel_state import TPGroup
from fastdeploy.distributed.rendezvous import LOAD_TIMEOUT_S, RankLost, Rendezvous
from fastdeploy.distributed.tcp_ring import RingComm
from fastdeploy.worker import messages, step_codec
from fastdeploy.worker.worker_group import PACKAGE_ROOT, WorkerError, deferred_sigint

logger = logging.getLogger(__name__)
T = TypeVar("T")
_LENGTH = struct.Struct("<Q")
HEARTBEAT_S = 5.0  # an idle rank 0 sends a Noop this often, well inside the ring's timeout the others wait with
_NODE_RANK_MAIN = ("import sys; sys.path.insert(0, sys.argv[1]); "
                   "from fastdeploy.worker.launched_group import main; main()")
_CHILD_EXIT_S = 30.0  # node ranks this process started finish within this once told to stop


def agreed_fields(config: EngineConfig) -> dict[str, str]:
    """What every rank must share with rank 0: the checkpoint's config and what decides the shards and steps."""
    checkpoint = json.dumps(config.model_config.hf_config, sort_keys=True, default=str)
    return {"step message version": str(step_codec.VERSION),
            "checkpoint config.json": hashlib.sha256(checkpoint.encode()).hexdigest()[:16],
            "tensor_parallel_size": str(config.tensor_parallel_size), "quantization": repr(config.quant),
            "dtype": str(config.dtype), "block_size": str(config.block_size),
            "max_model_len": str(config.max_model_len), "lm_head_fp32": str(config.lm_head_fp32),
            "speculative_config": json.dumps(config.speculative_config, sort_keys=True, default=str)}


class _Member:
    """This process's place in the launched group: the rendezvous, then the collectives once all have loaded."""

    def __init__(self, config: EngineConfig) -> None:
        launch = self.launch = config.launch
        self.children = start_node_ranks(config) if launch.starts_node_ranks else []
        self.rendezvous = Rendezvous(launch, agreed_fields(config))
        self.comm = RingComm(launch.rank, launch.world_size)
        self.tp = TPGroup(launch.rank, launch.world_size, self.comm)

    def wait_loaded(self) -> None:
        """Every rank has its shard: join the ring."""
        self.rendezvous.barrier("loaded", LOAD_TIMEOUT_S)
        self.comm.connect(self.rendezvous.store, self.launch.endpoints[self.launch.rank].rsplit(":", 1)[0])


class LaunchedGroup(_Member):
    """Rank 0's side: the other ranks of the launch, reached through the ring. Same surface as WorkerGroup."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # Only the ranks this process started (ips= form) are ours to see; the other nodes' and the launcher's are not.
        self.ranks_here, self.pids = self.launch.local_size, [p.pid for p in self.children]
        self.closed = False
        self.owner_pid = os.getpid()
        self._lock = threading.Lock()  # one message and its collectives at a time: steps, heartbeats, stop
        self._last_sent = time.monotonic()
        launch = self.launch
        logger.info("tensor parallel: %d ranks on %d node(s) %s, master %s:%d", launch.world_size, len(launch.nodes),
                    launch.nodes, launch.master_host, launch.master_port)

    def wait_loaded(self) -> None:
        super().wait_loaded()
        # Idle ranks wait for rank 0's next message, and give up after the ring's timeout: keep them hearing from it.
        threading.Thread(target=self._heartbeat, name="fastdeploy-tp-heartbeat", daemon=True).start()

    def allocate_kv(self, num_blocks: int) -> int:
        """The ranks' smallest block count (each sized its pool from its own host)."""
        with self._lock:
            return self._guard(lambda: self.comm.min_int(num_blocks))

    def run_step(self, message: messages.Step | messages.MtpStep, forward: Callable[[], T]) -> T:
        """Broadcast the step and run rank 0's forward of it, as WorkerGroup.run_step."""
        def step() -> T:
            self._send(message)
            return forward()

        with deferred_sigint(), self._lock:
            return self._guard(step)

    def parameters(self) -> list:
        raise NotImplementedError("the other ranks' parameters stay on their hosts; inspect them there")

    def _send(self, message: object) -> None:
        if self.closed:
            raise WorkerError("the tensor-parallel group was stopped after an earlier error; create a new LLM")
        self.comm.send(step_codec.encode(message))
        self._last_sent = time.monotonic()

    def _guard(self, work: Callable[[], T]) -> T:
        try:
            return work()
        except RankLost as e:
            self.closed = True  # the group is broken: nothing more can go through it
            raise WorkerError(f"{e}; the other ranks' logs say why. Create a new LLM once every node runs again") \
                from e

    def _heartbeat(self) -> None:
        while not self.closed:
            time.sleep(HEARTBEAT_S / 5)
            if time.monotonic() - self._last_sent < HEARTBEAT_S:
                continue  # busy: do not contend for the lock the steps hold
            with self._lock:
                if self.closed or time.monotonic() - self._last_sent < HEARTBEAT_S:
                    continue
                try:
                    self._send(messages.Noop())
                except RankLost:
                    self.closed = True  # the next step reports it
                    return

    def close(self) -> None:
        """Tell the other ranks to exit (status 0), or, before the group formed, why they should stop waiting.
        Idempotent; only the creating process acts."""
        if self.closed or os.getpid() != self.owner_pid:
            return
        with self._lock:
            self.closed = True
            try:
                if self.comm.attached:
                    self.comm.send(step_codec.encode(messages.Stop()))
                else:
                    self.rendezvous.announce_failure("rank 0 stopped before every rank had loaded")
            except (RankLost, RuntimeError) as e:
                logger.warning("could not tell the other tensor-parallel ranks to stop: %s", e)
            self.comm.close()
        for child in self.children:
            try:
                child.wait(_CHILD_EXIT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def serve_steps(config: EngineConfig) -> NoReturn:
    """Ranks > 0: load this rank's shard, run every step rank 0 broadcasts, then end the process (status 0 when
    rank 0 stopped us, 1 on an error, which rank 0 reports too)."""
    from fastdeploy.worker.forward import load_shard, rank_kv_caches
    from fastdeploy.worker.kv_plan import num_kv_blocks
    from fastdeploy.worker.tp_worker import StepServer

    launch, status = config.launch, 1
    try:
        member = _Member(config)
        ops.share_cores(launch.local_size)  # this host's cores, shared by its ranks
        try:
            model = load_shard(config, member.tp)
        except BaseException as e:
            member.rendezvous.announce_failure(f"loading failed: {type(e).__name__}: {e}")
            raise
        member.wait_loaded()
        tp = member.tp
        blocks = member.comm.min_int(num_kv_blocks(config, tp.size, launch.local_size))
        caches = rank_kv_caches(config, blocks, tp.size)
        logger.info("tensor-parallel rank %d of %d serves rank 0's steps (%d KV blocks)", launch.rank, tp.size, blocks)
        steps = StepServer(model, caches, config.block_size)
        while True:
            message = step_codec.decode(member.comm.receive())
            if isinstance(message, messages.Stop):
                status = 0
                break
            if not isinstance(message, messages.Noop):
                steps.run(message)
    except BaseException:
        logger.error("tensor-parallel rank %d stops after an error:\n%s", launch.rank, traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # skip the interpreter's teardown of paddle, and the rest of the user's script


def start_node_ranks(config: EngineConfig) -> list[subprocess.Popen]:
    """Under `ips=`: local ranks 1.. of this node (this process is its first), started and given their place."""
    procs = []
    for local_rank in range(1, config.launch.local_size):
        proc = subprocess.Popen([sys.executable, "-c", _NODE_RANK_MAIN, PACKAGE_ROOT], stdin=subprocess.PIPE,
                                start_new_session=True)
        payload = pickle.dumps((config, local_rank))  # to our own child through a pipe: nobody else in between
        proc.stdin.write(_LENGTH.pack(len(payload)) + payload)
        proc.stdin.flush()  # and keep it open: its end-of-file tells the child that we are gone
        procs.append(proc)
    return procs


def _read_stdin(n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))  # unbuffered: the parent-watch thread reads fd 0 after us
        if not chunk:
            raise SystemExit("a node's tensor-parallel rank takes its place from the node's first rank (ips=)")
        data += chunk
    return data


def main() -> NoReturn:
    """A node rank that `start_node_ranks` started."""
    from fastdeploy.worker.tp_worker import exit_when_parent_goes

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the node's first rank's to handle
    config, local_rank = pickle.loads(_read_stdin(_LENGTH.unpack(_read_stdin(_LENGTH.size))[0]))
    first = config.launch
    config.launch = dataclasses.replace(first, rank=first.rank + local_rank, local_rank=local_rank,
                                        starts_node_ranks=False)
    logging.basicConfig(level=logging.INFO,
                        format=f"[tensor-parallel rank {config.launch.rank}] %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=exit_when_parent_goes, name="parent-watch", daemon=True).start()
    serve_steps(config)
