"""Our engine measured the way llama.cpp's `llama-batched-bench` measures, row for row.

    .venv/bin/python benchmarks/batched_bench.py                         # bf16, wint8, wint4; B = 1, 16, 64
    .venv/bin/python benchmarks/batched_bench.py --formats wint4 --batches 1 --json out.json
    .venv/bin/python benchmarks/batched_bench.py --llama-bench /work/llama.cpp/build/bin/llama-batched-bench \
        --gguf F16=/work/gguf/ernie45-0.3b-random-f16.gguf,Q8_0=...,Q4_0=...   # llama.cpp in the same run

Checkpoint: the ERNIE-4.5-0.3B-shaped random bf16 one of offline_throughput.py (written on first use).
For each B, B prompts of PP = 128 random token ids (as llama.cpp's random tokens), greedy, ignore_eos:
  T_PP  from adding the B requests to the moment every one has its first token: the prompt forward of
        all B x PP tokens (one engine step: max_num_batched_tokens = max(B) x PP, max_num_seqs = max(B);
        llama.cpp's -b 2048 -ub 512 runs the same tokens as ubatches of 512) plus sampling the first token.
  T_TG  the rest: TG = 128 decode steps of B tokens each, so every sequence ends with TG + 1 = 129
        output tokens. llama.cpp's TG phase is likewise 128 forward passes of B tokens after the prompt
        (it feeds random tokens and does not sample; we sample greedily over the vocabulary).
  S_PP = B*PP / T_PP, S_TG = B*TG / T_TG, S = B*(PP+TG) / (T_PP+T_TG)   (llama.cpp's formulas, -pps off)
Each format runs in its own process (clean memory and thread pools) after a 16-token warm-up, as
llama.cpp warms up with 16 tokens. The script prints the CPU's AVX-512 flags, the read bandwidth
(large_models.read_bandwidth_gbs: AVX2 streaming sum, all cores; read again after each format) and, for
B = 1, the bandwidth bound: bytes of packed weights one decode step streams
(large_models.decode_bytes_per_token) / the mean of the reads before and after that format.
With --llama-bench it ends with ours / llama.cpp per B and speed for the matching formats (bf16 / F16,
wint8 / Q8_0, wint4 / Q4_0: the --gguf labels), the tables docs/benchmarks.md keeps per machine.
Run it under the shared CPU lock: flock /tmp/cpu.lock .venv/bin/python benchmarks/batched_bench.py
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_models import add_isa_argument, decode_bytes_per_token, isa, read_bandwidth_gbs, use_isa  # noqa: E402
from offline_throughput import CKPT, FORMATS, build_checkpoint, make_prompts  # noqa: E402

if TYPE_CHECKING:
    from fastdeploy import LLM

PP, TG = 128, 128
COLUMNS = ("T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")
PEERS = {"bf16": "F16", "wint8": "Q8_0", "wint4": "Q4_0"}  # llama.cpp's matching format (its --gguf label)


def one_round(llm: LLM, batch: int, pp: int, tg: int) -> dict[str, float]:
    """Step the engine directly so the prompt and generation phases are timed apart."""
    from fastdeploy import SamplingParams
    from fastdeploy.worker.compiled_step import WEIGHT_PHASES

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tg + 1, ignore_eos=True, detokenize=False)
    requests = []
    for ids in make_prompts(batch, pp):
        requests += engine.make_requests(None, ids, params, len(requests), time.time())
    rejected = [r.error_msg for r in requests if r.is_finished]
    if rejected:
        raise RuntimeError(f"B={batch}: requests rejected: {rejected[:2]}")
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    pp_steps = tg_steps = 0
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
        pp_steps += 1
    compiled = engine.runner.compiled
    if compiled is not None:
        compiled.phase_seconds()  # restart the compiled step's phase timers
    prompt_done = time.perf_counter()
    while not all(r.is_finished for r in requests):
        engine.step()
        tg_steps += 1
    end = time.perf_counter()
    # Share of the decode time outside the weight-streaming phases: attention, norms, rotary, activation,
    # embedding and all the engine's Python (None when the forward ran layer by layer).
    outside = None
    if compiled is not None:
        phases = compiled.phase_seconds()
        outside = 1.0 - sum(phases[p] for p in WEIGHT_PHASES) / (end - prompt_done)
    counts = {r.num_output_tokens for r in requests}
    if counts != {tg + 1}:
        raise RuntimeError(f"B={batch}: expected {tg + 1} output tokens per sequence, got {sorted(counts)}")
    t_pp, t_tg = prompt_done - start, end - prompt_done
    return {"pp": pp, "tg": tg, "pl": batch, "n_kv": batch * (pp + tg), "t_pp": t_pp, "speed_pp": batch * pp / t_pp,
            "t_tg": t_tg, "speed_tg": batch * tg / t_tg, "t": t_pp + t_tg,
            "speed": batch * (pp + tg) / (t_pp + t_tg), "pp_steps": pp_steps, "tg_steps": tg_steps,
            "tg_outside_weights": outside}


def run_child(fmt: str, batches: list[int], reps: int, kernels: str) -> dict:
    from fastdeploy import LLM, SamplingParams
    from fastdeploy.ops.build import runtime_info

    use_isa(kernels)
    llm = LLM(model=str(CKPT), quantization=FORMATS[fmt], max_model_len=512, max_num_seqs=max(batches),
              max_num_batched_tokens=max(batches) * PP, enable_chunked_prefill=True, enable_prefix_caching=False)
    llm.generate(make_prompts(1, 16), SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False),
                 use_tqdm=False)  # warm-up: 16 prompt tokens, as llama-batched-bench
    rows = []
    for batch in batches:
        runs = sorted((one_round(llm, batch, PP, TG) for _ in range(reps)), key=lambda r: r["t"])
        rows.append(runs[len(runs) // 2])  # the round with the median total time (the slower of two middles)
    return {"rows": rows, "decode_bytes_per_token": decode_bytes_per_token(llm.engine.runner.model, 1, 1),
            "runtime": runtime_info()}


def run_llama_cpp(binary: str, gguf: Path, batches: list[int], threads: int) -> dict:
    """llama-batched-bench with the command line docs/benchmarks.md records, JSONL rows parsed."""
    ctx = max(batches) * (PP + TG)
    cmd = [binary, "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(PP), "-ntg", str(TG),
           "-npl", ",".join(map(str, batches)), "-t", str(threads), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {"rows": rows, "command": " ".join(cmd), "bytes": gguf.stat().st_size}


def cpu_flags() -> list[str]:
    return sorted(set(re.findall(r"avx512[a-z_0-9]*", Path("/proc/cpuinfo").read_text())))


def print_rows(label: str, rows: list[dict]) -> None:
    print(f"\n{label}\n|    PP |     TG |    B |   N_KV | " + " | ".join(f"{c:>8}" for c in COLUMNS) + " |")
    print("|-------|--------|------|--------|" + "|".join("-" * 10 for _ in COLUMNS) + "|")
    for r in rows:
        print(f"| {r['pp']:5d} | {r['tg']:6d} | {r['pl']:4d} | {r['n_kv']:6d} | {r['t_pp']:8.3f} | "
              f"{r['speed_pp']:8.2f} | {r['t_tg']:8.3f} | {r['speed_tg']:8.2f} | {r['t']:8.3f} | {r['speed']:8.2f} |")


def bound_line(rows: list[dict], bytes_per_token: float, before: float, after: float) -> str | None:
    """The B = 1 row against the bandwidth bound, at the mean of the reads taken before and after the format ran."""
    one = [r for r in rows if r["pl"] == 1]
    if not one:
        return None
    bandwidth = (before + after) / 2
    bound = bandwidth * 1e9 / bytes_per_token
    moved = abs(before - after) > 0.15 * max(before, after)
    return (f"B=1: {bytes_per_token / 1e6:.0f} MB of weights per token, bound {bound:.1f} tok/s at "
            f"{bandwidth:.1f} GB/s (read {before:.1f} before, {after:.1f} after"
            + ("; it moved during the run, so this share is unreliable" if moved else "")
            + f"); S_TG {one[0]['speed_tg']:.1f} = {one[0]['speed_tg'] / bound:.0%} of it"
            + (f"; {one[0]['tg_outside_weights']:.1%} of a decode step outside the weight streaming"
               if one[0].get("tg_outside_weights") is not None else ""))


def comparison(report: dict) -> list[str]:
    """Markdown rows of ours / llama.cpp per B and speed, for each format run on both sides (issue 14's
    targets: >= 1.5x at B > 1 and in S_PP, >= 85 % of the bandwidth bound at B = 1)."""
    pairs = [(f, PEERS[f]) for f in report["ours"] if PEERS[f] in report["llama.cpp"]]
    if not pairs:
        return []
    lines = ["| B | | " + " | ".join(f"{f} / {g}" for f, g in pairs) + " |", "|---|---|" + "---|" * len(pairs)]
    batches = [r["pl"] for r in report["ours"][pairs[0][0]]["rows"]]
    for b in batches:
        for key, name in (("speed_pp", "S_PP"), ("speed_tg", "S_TG"), ("speed", "S")):
            cells = []
            for f, g in pairs:
                ours = next(r[key] for r in report["ours"][f]["rows"] if r["pl"] == b)
                peer = next((r[key] for r in report["llama.cpp"][g]["rows"] if r["pl"] == b), None)
                cells.append(f"{ours:.1f} / -" if peer is None else f"{ours:.1f} / {peer:.1f} ({ours / peer:.2f}x)")
            lines.append(f"| {b if name == 'S_PP' else ''} | {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {list(FORMATS)}")
    parser.add_argument("--batches", default="1,16,64", help="comma list of B (parallel sequences), llama's -npl")
    parser.add_argument("--reps", type=int, default=1, help="rounds per B; the median-total-time one is kept")
    parser.add_argument("--llama-bench", help="path of llama-batched-bench: run it too, on --gguf")
    parser.add_argument("--gguf", default="", help="LABEL=PATH,... GGUF files for --llama-bench")
    add_isa_argument(parser)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's -t (ours uses all cores)")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one format, print JSON
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or min(batches) < 1 or args.reps < 1:
        parser.error(f"unknown formats {unknown}" if unknown else "--batches and --reps must be >= 1")
    ggufs = dict(item.split("=", 1) for item in args.gguf.split(",") if item)
    if ggufs and not args.llama_bench:
        parser.error("--gguf needs --llama-bench")
    if args.child:
        logging.disable(logging.WARNING)
        print(json.dumps(run_child(args.child, batches, args.reps, args.isa)))
        return

    build_checkpoint()
    flags = cpu_flags()
    bandwidth = read_bandwidth_gbs()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU best {isa()}, "
          f"kernels --isa {args.isa}; "
          f"CPU flags: {' '.join(flags) or 'no avx512'}", flush=True)
    print(f"# read bandwidth {bandwidth:.1f} GB/s; PP {PP}, TG {TG}, B {args.batches}", flush=True)
    report = {"machine": {"cpu_flags": flags, "isa": isa(), "kernels": args.isa, "cores": os.cpu_count(),
                          "bandwidth_gbs": bandwidth,
                          "date": time.strftime("%Y-%m-%d %H:%M")}, "ours": {}, "llama.cpp": {}}
    for fmt in formats:
        before = bandwidth
        done = subprocess.run([sys.executable, __file__, "--child", fmt, "--batches", args.batches,
                               "--reps", str(args.reps), "--isa", args.isa], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{fmt}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        bandwidth = read_bandwidth_gbs()  # again: on a shared machine it can move by half within seconds
        result["bandwidth_gbs"] = [before, bandwidth]
        report["ours"][fmt] = result
        rt = result["runtime"]
        print_rows(f"ours {fmt} (kernels {rt['active_isa']} of {rt['detected_isa']}, {rt['num_threads']} threads)",
                   result["rows"])
        line = bound_line(result["rows"], result["decode_bytes_per_token"], before, bandwidth)
        if line:
            print(line, flush=True)
    for label, path in ggufs.items():
        result = run_llama_cpp(args.llama_bench, Path(path), batches, args.threads)
        report["llama.cpp"][label] = result
        print_rows(f"llama.cpp {label} ({result['command']})", result["rows"])
    table = comparison(report)
    if table:
        print("\nours / llama.cpp, tok/s (ratio)\n" + "\n".join(table), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
