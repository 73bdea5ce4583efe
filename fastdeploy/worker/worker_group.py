"""Rank 0's side of tensor parallel: starts the worker ranks, hands them each step, and stops them.

Workers are child processes of this interpreter running `fastdeploy.worker.tp_worker.main`, each in
its own session (the terminal's Ctrl-C reaches only rank 0). Their stdin is a pipe that rank 0 never
writes to after the bootstrap line: when rank 0 dies, however it dies, the pipe closes and the
worker exits. Steps go over a localhost TCP channel (`engine_worker_queue_port`, or the next free
port); the collectives of the forward itself go through a shared-memory segment each worker inherits
(distributed/shm_comm.py). Nothing listens beyond 127.0.0.1.

Lifetime: `close()` runs when the ModelRunner is garbage-collected (weakref.finalize), at
interpreter exit, or after an error that may have left the ranks out of step. It asks the workers
to stop, and kills any that do not within a few seconds.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from fastdeploy import ops
from fastdeploy.config import EngineConfig
from fastdeploy.distributed import channel
from fastdeploy.distributed.parallel_state import TPGroup
from fastdeploy.distributed.shm_comm import ShmComm, create_segment
from fastdeploy.worker import messages

logger = logging.getLogger(__name__)
T = TypeVar("T")

TOKEN_BYTES = 16
HELLO = struct.Struct("<I")  # the worker's rank, after its token
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 5.0

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_WORKER_MAIN = "import sys; sys.path.insert(0, sys.argv[1]); from fastdeploy.worker.tp_worker import main; main()"
_live_groups: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


def _forget_inherited_groups() -> None:
    """In a process forked from rank 0: the workers are not ours. Drop our copies of their pipes and
    sockets (or a dead rank 0 would look alive to them) and never stop them from here."""
    for group in list(_live_groups):
        group.disown()


os.register_at_fork(after_in_child=_forget_inherited_groups)


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or went away."""


@contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold back Ctrl-C until the block is done, then deliver it: every rank must finish the
    step's collectives, or the workers would wait in one forever. (Only the main thread receives
    signals; elsewhere this does nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            signal.raise_signal(signal.SIGINT)  # to the handler the user had: KeyboardInterrupt by default


class WorkerGroup:
    """Worker ranks 1..N-1 and this process's membership (rank 0) of their process group."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        self.ranks_here = self.size  # all on this host
        self.procs: list[subprocess.Popen] = []
        self.socks: list[socket.socket] = []
        self.closed = False
        self.owner_pid = os.getpid()
        _live_groups.add(self)
        listener = channel.listen_from(config.engine_worker_queue_port)
        segment = create_segment(self.size)  # the collectives' shared memory, inherited by the workers
        try:
            self.port = listener.getsockname()[1]
            token = secrets.token_bytes(TOKEN_BYTES)
            for rank in range(1, self.size):
                self._spawn(rank, token, segment)
            self.socks = self._accept(listener, token)
            comm = ShmComm(segment, 0, self.size)
            self.send_all(messages.Init(config))
            comm.join(self._check_startup(time.monotonic() + STARTUP_TIMEOUT_S))
            self.tp = TPGroup(0, self.size, comm)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
            os.close(segment)
        logger.info("tensor parallel: %d ranks (workers %s), step channel on port %d, shared-memory collectives",
                    self.size, [p.pid for p in self.procs], self.port)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _spawn(self, rank: int, token: bytes, segment: int) -> None:
        # This interpreter, importing this very fastdeploy (which may not be installed where the child looks).
        proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, PACKAGE_ROOT], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, start_new_session=True, pass_fds=(segment,))
        self.procs.append(proc)
        bootstrap = {"rank": rank, "world_size": self.size, "port": self.port, "token": token.hex(),
                     "segment": segment, "cores": ops.core_budget()}
        proc.stdin.write(json.dumps(bootstrap).encode() + b"\n")
        proc.stdin.flush()  # and keep it open: its end-of-file tells the worker that rank 0 is gone

    def _accept(self, listener: socket.socket, token: bytes) -> list[socket.socket]:
        by_rank: dict[int, socket.socket] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        listener.settimeout(1.0)  # to notice a worker that died before connecting
        while len(by_rank) < self.size - 1:
            self._check_alive()
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers did not connect within {STARTUP_TIMEOUT_S:.0f} s")
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(30.0)
            try:
                hello = channel.recv_bytes(sock, TOKEN_BYTES + HELLO.size)
            except (OSError, channel.ChannelClosed):
                sock.close()
                continue
            (rank,) = HELLO.unpack(hello[TOKEN_BYTES:])
            if not hmac.compare_digest(hello[:TOKEN_BYTES], token) or not 0 < rank < self.size or rank in by_rank:
                sock.close()  # not one of ours
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            by_rank[rank] = sock
        return [by_rank[r] for r in range(1, self.size)]

    def _check_startup(self, deadline: float) -> Callable[[], None]:
        def check() -> None:
            self._check_alive()
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers did not join within {STARTUP_TIMEOUT_S:.0f} s")
        return check

    def dead_workers(self, grace_s: float = 0.0) -> str:
        """'worker rank r (pid p) exited with code c', for each worker that has exited ('' if none).
        grace_s: how long to give a worker whose connection just broke to finish exiting."""
        for proc in self.procs if grace_s else ():
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        return ", ".join(f"worker rank {rank} (pid {proc.pid}) exited with code {proc.poll()}"
                         for rank, proc in enumerate(self.procs, start=1) if proc.poll() is not None)

    def _check_alive(self) -> None:
        dead = self.dead_workers()
        if dead:
            raise WorkerError(f"tensor-parallel {dead}; its error is printed above")

    # ---- after startup ------------------------------------------------------------------------
    def wait_loaded(self) -> None:
        """Until every worker has loaded its shard."""
        self.receive_all()

    def allocate_kv(self, num_blocks: int) -> int:
        """Every worker allocates `num_blocks` KV blocks (rank 0 sized the pool for all of this host's ranks)."""
        self.send_all(messages.AllocateKV(num_blocks))
        self.receive_all()
        return num_blocks

    def parameters(self) -> list[dict]:
        """Each worker's parameters (its shard of the model), in rank order."""
        self.send_all(messages.GetParameters())
        return [reply.weights for reply in self.receive_all()]

    def run_step(self, message: messages.Step | messages.MtpStep, forward: Callable[[], T]) -> T:
        """Send the step to every worker and run rank 0's `forward` of it: every rank runs the same forward,
        whose collectives keep them in step. Ctrl-C waits until the step is done; a failure stops the workers
        (the others may be waiting in a collective that never comes)."""
        with deferred_sigint():
            self.send_all(message)
            try:
                return forward()
            except BaseException as e:
                dead = self.dead_workers(grace_s=0.2)
                self.close(kill=True)
                if dead:
                    raise WorkerError(f"tensor-parallel {dead} during a step; create a new LLM") from e
                raise

    def send_all(self, message: object) -> None:
        if self.closed:
            raise WorkerError("the tensor-parallel workers were stopped after an earlier error; create a new LLM")
        try:
            for sock in self.socks:
                channel.send(sock, message)
        except OSError as e:
            self.close()
            raise WorkerError(f"lost a tensor-parallel worker: {e}") from e

    def receive_all(self) -> list[object]:
        """One reply from every worker, in rank order; a worker's Failed becomes a WorkerError."""
        replies = []
        try:
            for rank, sock in enumerate(self.socks, start=1):
                reply = channel.recv(sock)
                if isinstance(reply, messages.Failed):
                    raise WorkerError(f"tensor-parallel worker rank {rank} failed:\n{reply.traceback}")
                replies.append(reply)
        except (OSError, channel.ChannelClosed) as e:
            self.close()
            raise WorkerError(f"lost a tensor-parallel worker: {e}") from e
        except WorkerError:
            self.close()
            raise
        return replies

    def disown(self) -> None:
        for sock in self.socks:
            sock.close()
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        self.procs, self.socks, self.closed = [], [], True

    def close(self, kill: bool = False) -> None:
        """Stop the workers: ask, then wait, then kill (at once with kill=True, for workers that may be
        stuck in a collective). Idempotent; safe at interpreter exit; only the creating process acts."""
        if (self.closed and not self.procs) or os.getpid() != self.owner_pid:
            return
        self.closed = True
        if kill:
            for proc in self.procs:
                proc.kill()
        for sock in self.socks:
            try:
                channel.send(sock, messages.Stop())
            except OSError:
                pass
            sock.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        self.procs = []
        self.socks = []
