"""Tensor parallel across hosts, measured on loopback: two `paddle.distributed.launch` "nodes" on this machine
against tp=2 on one host (shared-memory collectives), same run.

    .venv/bin/python benchmarks/multinode.py                  # the demo model
    .venv/bin/python benchmarks/multinode.py --model PATH --quantization wint4 --json out.json

Three parts:
  collectives  the ranks' ring (tcp_ring.py): all-reduce, gather to rank 0 and step broadcast between two launched ranks,
               per message size: median microseconds of --reps calls (the floor a real network adds its wire time to)
  decode       one-stream decode and --streams-stream output tok/s (greedy, --tokens each, no EOS): tp=2 on one host
               against tp=2 as two loopback nodes
  bytes        what crosses the network per decoded token and per prompt token at tp=2, from the model's shape
               (and ERNIE-4.5-21B-A3B's and -300B-A47B's): activations are float32, so each all-reduce moves
               hidden x 4 bytes per token each way; rank 1 sends its half of the logits of each sampled row
Each loopback "node" runs its rank with half of the cores' threads (ops.limit_cores), as tp=2 on one host does, so
both setups compute alike and differ in the transport. Prints the kernels' ISA: compare figures only between runs
on the same kind of machine.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.ops.build import runtime_info  # noqa: E402

SHAPES = {"ERNIE-4.5-21B-A3B": (2560, 28, 103424), "ERNIE-4.5-300B-A47B": (8192, 54, 103424)}  # hidden, layers, vocab


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_rates(llm: LLM, streams: int, tokens: int) -> dict[str, float]:
    """tok/s of one stream and of `streams` streams (best of two runs each, after a warm-up)."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    result = {}
    for n in (1, streams):
        batch = [{"prompt_token_ids": rng.integers(10, 1000, 16).tolist()} for _ in range(n)]
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        result[f"{n} streams tok/s"] = n * tokens / best
    return result


def collectives(reps: int, hidden: int, vocab: int) -> dict[str, float]:
    """Median microseconds per call on the launched group (run by each rank; rank 0's figures are kept)."""
    import paddle

    from fastdeploy.distributed.launch import Launch
    from fastdeploy.distributed.rendezvous import Rendezvous
    from fastdeploy.distributed.tcp_ring import RingComm

    launch = Launch.from_environ()
    rendezvous = Rendezvous(launch, {})
    rendezvous.barrier("bench", 60)
    comm = RingComm(launch.rank, launch.world_size)
    comm.connect(rendezvous.store, launch.endpoints[launch.rank].rsplit(":", 1)[0])
    cases = {f"all-reduce {rows} x {hidden} fp32": lambda rows=rows: comm.all_reduce(paddle.ones([rows, hidden]))
             for rows in (1, 16, 256)}
    cases[f"gather to rank 0, 1 x {vocab // 2} fp32"] = lambda: comm.gather_to_first(paddle.ones([1, vocab // 2]))
    for size in (200, 20_000):
        message = bytes(size)
        cases[f"step broadcast {size} B"] = (lambda m=message: comm.send(m)) if launch.rank == 0 else comm.receive
    times = {}
    for name, call in cases.items():
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples) * 1e6
    return times


def wire_bytes(hidden: int, layers: int, vocab: int) -> dict[str, float]:
    """Bytes one rank sends per decoded token at tp=2: 2 all-reduces per layer and the embedding's, a ring
    moving hidden x 4 bytes each way at two ranks, and rank 1's half of the logits to rank 0."""
    reduces = 2 * layers + 1
    return {"all-reduces per step": reduces, "all-reduce KB per token": reduces * hidden * 4 / 1e3,
            "logits KB per sampled token (rank 1 -> 0)": vocab // 2 * 4 / 1e3}


def as_rank(args: argparse.Namespace) -> None:
    """Under the launcher: rank 0 measures and writes args.out; the other rank serves."""
    from fastdeploy import ops

    ops.limit_cores(max(1, len(os.sched_getaffinity(0)) // 2))  # two "hosts" share this one's cores
    if args.role == "collectives":
        hidden, vocab = json.loads(args.shape)
        times = collectives(args.reps, hidden, vocab)
        if int(os.environ["PADDLE_TRAINER_ID"]) == 0:
            Path(args.out).write_text(json.dumps(times))
        return
    llm = LLM(model=args.model, tensor_parallel_size=2, quantization=args.quantization, max_num_seqs=args.streams)
    Path(args.out).write_text(json.dumps(decode_rates(llm, args.streams, args.tokens)))


def launched(args: argparse.Namespace, role: str, extra: list[str]) -> dict:
    """Two launcher invocations on loopback running this file as `role`; rank 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out, port = Path(tmp) / "out.json", free_port()
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--master", f"127.0.0.1:{port}", "--nnodes", "2",
               "--nproc_per_node", "1"]
        script = [__file__, "--role", role, "--out", str(out), "--model", args.model, "--reps", str(args.reps),
                  "--streams", str(args.streams), "--tokens", str(args.tokens), *extra]
        if args.quantization:
            script += ["--quantization", args.quantization]
        nodes = [subprocess.Popen([*cmd, "--log_dir", f"{tmp}/node{n}", *script], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for n in range(2)]
        codes = [node.wait(timeout=3600) for node in nodes]
        if codes != [0, 0] or not out.exists():
            logs = "\n".join(p.read_text()[-2000:] for p in Path(tmp).glob("node*/workerlog.*"))
            raise SystemExit(f"launched {role} failed {codes}:\n{logs}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "ernie-4.5-demo"))
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--role", choices=["collectives", "decode"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        return as_rank(args)
    rt = runtime_info()
    config = json.loads((Path(args.model) / "config.json").read_text())
    shape = (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"])
    print(f"ISA {rt['active_isa']} (detected {rt['detected_isa']}), {os.cpu_count()} CPUs; model {args.model}")
    results = {"isa": rt["active_isa"], "model": args.model, "quantization": args.quantization}
    results["collectives us"] = launched(args, "collectives", ["--shape", json.dumps([shape[0], shape[2]])])
    results["one host, tp=2 (shared memory)"] = decode_rates(
        LLM(model=args.model, tensor_parallel_size=2, quantization=args.quantization, max_num_seqs=args.streams),
        args.streams, args.tokens)
    results["two loopback nodes, tp=2 (TCP ring)"] = launched(args, "decode", [])
    results["bytes at tp=2"] = {name: wire_bytes(*s) for name, s in {"this model": shape, **SHAPES}.items()}
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
