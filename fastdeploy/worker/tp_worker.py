"""A tensor-parallel worker rank: `main()` here, run by rank 0 (worker_group.py) in a child process of
the same interpreter.

It reads one bootstrap line (rank, world size, channel port, token, the inherited descriptor of the
collectives' shared memory) from stdin, connects to rank 0's channel, joins the collectives, loads its
shard of the model and then runs every step rank 0 sends, until it is told to stop, its channel closes,
or its stdin reaches end-of-file (rank 0 died).
It never reads the terminal's Ctrl-C: it runs in its own session and ignores SIGINT.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any

from fastdeploy.distributed import channel
from fastdeploy.distributed.parallel_state import TPGroup
from fastdeploy.distributed.shm_comm import ShmComm
from fastdeploy.worker import messages
from fastdeploy.worker.worker_group import HELLO

logger = logging.getLogger("fastdeploy.tp_worker")


def _read_line(fd: int) -> bytes:
    """One line from `fd`, read unbuffered so that nothing after it is consumed."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise SystemExit("tensor-parallel worker: no bootstrap line on stdin (start it through LLM)")
        line += chunk
    return line


def exit_when_parent_goes() -> None:
    """Block on stdin; rank 0 never writes after the bootstrap line, so end-of-file means it is gone."""
    try:
        while os.read(0, 4096):  # the raw fd: a buffered reader's lock would trouble interpreter shutdown
            pass
    finally:
        os._exit(0)  # no cleanup to wait for: the parent that would use our results is gone


class Worker:
    def __init__(self, sock: Any, rank: int, world_size: int, segment: int, cores: int) -> None:
        self.sock = sock
        self.rank = rank
        self.world_size = world_size
        self.segment = segment  # the collectives' shared memory, inherited from rank 0
        self.cores = cores  # rank 0's core budget, which the ranks share
        self.config: Any = None  # the EngineConfig rank 0 sends
        self.model: Any = None
        self.kv_caches: list[Any] = []
        self.block_size = 0

    def start(self, config: Any) -> None:
        from fastdeploy import ops
        from fastdeploy.worker.forward import load_shard

        comm = ShmComm(self.segment, self.rank, self.world_size)
        os.close(self.segment)
        comm.join()
        tp = TPGroup(self.rank, self.world_size, comm)
        ops.limit_cores(self.cores)
        ops.share_cores(self.world_size)
        self.model = load_shard(config, tp)
        self.block_size = config.block_size
        self.config = config

    def allocate(self, num_blocks: int) -> None:
        from fastdeploy.worker.forward import rank_kv_caches

        self.kv_caches = rank_kv_caches(self.config, num_blocks, self.world_size)

    def serve(self) -> None:
        steps: StepServer | None = None
        while True:
            try:
                message = channel.recv(self.sock)
            except (channel.ChannelClosed, OSError):
                return  # rank 0 closed the channel
            if isinstance(message, (messages.Step, messages.MtpStep)):
                steps.run(message)
            elif isinstance(message, messages.Init):
                self.start(message.config)
                channel.send(self.sock, messages.Ready())
            elif isinstance(message, messages.AllocateKV):
                self.allocate(message.num_blocks)
                steps = StepServer(self.model, self.kv_caches, self.block_size)
                channel.send(self.sock, messages.Ready())
            elif isinstance(message, messages.GetParameters):
                from fastdeploy.model_executor.weight_format import named_weights

                channel.send(self.sock, messages.Parameters(named_weights(self.model)))
            elif isinstance(message, messages.Stop):
                return
            else:
                raise ValueError(f"unknown message {message!r} from rank 0")


class StepServer:
    """A worker rank's part of each step: rank 0's forwards (Step) and MTP layer runs (MtpStep) on its shard."""

    def __init__(self, model: Any, kv_caches: list[Any], block_size: int) -> None:
        from fastdeploy.worker.forward import VisionCache

        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.vision = VisionCache()  # the vision tower is replicated: each rank encodes a request's media itself
        self.mtp: Any = None  # the MTP layer's runs on this rank's shard (speculative_config "mtp")

    def run(self, message: messages.Step | messages.MtpStep) -> None:
        from fastdeploy.worker.forward import run_step_keeping
        from fastdeploy.worker.mtp_proposer import MtpLayer

        if isinstance(message, messages.Step):
            _, hidden = run_step_keeping(self.model, message.batch, self.block_size, self.kv_caches, self.vision)
            if len(message.batch.hidden_rows):
                self.mtp = self.mtp or MtpLayer(self.model, self.kv_caches, self.block_size)
                self.mtp.main = hidden
        else:
            self.mtp.run(message.step)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    bootstrap = json.loads(_read_line(0))
    rank, world_size = int(bootstrap["rank"]), int(bootstrap["world_size"])
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[tensor-parallel rank {rank}] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("fastdeploy")  # rank 0 reports what all ranks do; workers only warnings
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    root.propagate = False
    threading.Thread(target=exit_when_parent_goes, name="parent-watch", daemon=True).start()
    sock = channel.connect(int(bootstrap["port"]))
    sock.sendall(bytes.fromhex(bootstrap["token"]) + HELLO.pack(rank))
    worker = Worker(sock, rank, world_size, int(bootstrap["segment"]), int(bootstrap["cores"]))
    try:
        worker.serve()
    except BaseException:
        text = traceback.format_exc()
        logger.error("stopping after an error:\n%s", text)
        try:
            channel.send(sock, messages.Failed(text))
        except OSError:
            pass
        os._exit(1)
    sock.close()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown of paddle: nothing is left to save


if __name__ == "__main__":
    main()
