"""`fastdeploy bench latency|throughput|serve`: one front door to the benchmark scripts of the checkout's
benchmarks/ directory, run as they are in a subprocess with the remaining arguments passed through.
The scripts are not part of the installed package (they write checkpoints, compare other engines), so
the package never imports them; installed without the checkout, the command says so."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# fastdeploy/cli/bench.py -> the checkout's root holds benchmarks/ next to fastdeploy/.
BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
# sub-command -> (script, what it measures), as FastDeploy's / vLLM's `bench` names them.
SCRIPTS = {
    "latency": ("batched_bench.py", "prompt-processing and per-token generation time at batch sizes B, measured "
                                    "as llama.cpp's llama-batched-bench"),
    "throughput": ("offline_throughput.py", "offline LLM.generate throughput (tokens/s) per workload and weight "
                                            "format"),
    "serve": ("serving.py", "a running OpenAI-compatible server under concurrent streamed requests: TTFT, TPOT, "
                            "throughput (and offline generate on the same workload)"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmark the engine or a server (the checkout's benchmarks/ scripts)",
        description="Run one of the benchmark scripts of the checkout's benchmarks/ directory (docs/benchmarks.md). "
                    "Arguments after the benchmark's name go to the script: `fastdeploy bench latency --help` "
                    "prints its own flags.")
    kinds = bench.add_subparsers(dest="bench", metavar="{latency,throughput,serve}", required=True)
    for name, (script, what) in SCRIPTS.items():
        # No -h of its own: --help goes through to the script, whose flags these are.
        kind = kinds.add_parser(name, help=f"{what} (benchmarks/{script})", add_help=False,
                                description=f"{what}; runs benchmarks/{script}")
        kind.add_argument("script_args", nargs=argparse.REMAINDER, help=f"arguments of benchmarks/{script}")


def run(kind: str, script_args: list[str]) -> int:
    """Run benchmark `kind` with `script_args`; its exit status. main() hands the words after the benchmark's
    name here untouched (argparse would take a leading --help for its own)."""
    script = BENCHMARKS_DIR / SCRIPTS[kind][0]
    if not script.is_file():
        print(f"fastdeploy bench {kind}: error: {script} not found: the benchmarks are scripts of the source "
              "checkout, not of the installed package; run this command from an editable install "
              "(`pip install -e .` in the checkout)", file=sys.stderr)
        return 2
    # The same interpreter, so the scripts see this package and its dependencies.
    return subprocess.run([sys.executable, str(script), *script_args], check=False).returncode
