"""Seed-sized models on one machine: load time, peak memory and throughput per weight format.

    .venv/bin/python benchmarks/large_models.py --model ernie-4.5-21b-a3b --layers 4
    .venv/bin/python benchmarks/large_models.py --model qwen2-7b --formats bf16,wint8,wint4
    .venv/bin/python benchmarks/large_models.py --model qwen3-30b-a3b --formats wint4
    .venv/bin/python benchmarks/large_models.py --model llama-3.1-8b --formats bf16,wint8,wint4
    .venv/bin/python benchmarks/large_models.py --model ernie-4.5-21b-a3b --formats wint4 --workloads decode
    .venv/bin/python benchmarks/large_models.py --model ernie-4.5-21b-a3b --layers 4 --isa avx2   # AVX2 kernels
    ... --json results.json

A random checkpoint of the real shape (tools/random_checkpoint.py; --layers cuts the depth) is
written to benchmarks/.cache/ on first use. Each format loads in its own process, which reports:
load time (LLM() construction, from the page cache when the files fit in it), peak RSS of that process
(loading and running), packed weight and KV pool sizes, and per workload (greedy, fixed lengths):
  decode   one 128-token prompt, 128 output tokens: decode tok/s (after the first token)
  W16      16 prompts x 128 tokens, 128 output tokens each: output tok/s over the whole run
  prompt   16 prompts x 128 tokens, one output token: prompt tok/s
and the memory-bandwidth bound of one-stream decode: bytes of weights read per token (attention, dense
MLPs, top_k / E of each MoE layer's experts, shared experts, routers, LM head) / the machine's read
bandwidth, measured by a small AVX2 streaming sum over 1 GiB on all cores (compiled here with cc).
--isa picks the kernels' instruction set in each child (avx2 runs the AVX2 path on an AVX-512 CPU).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from random_checkpoint import SHAPES, write_checkpoint  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
FORMATS = {"bf16": None, "wint8": "wint8", "wint4": "wint4"}
WORKLOADS = {"decode": (1, 128, 128), "W16": (16, 128, 128), "prompt": (16, 128, 1)}
ISA_CHOICES = ("best", "avx2", "avx512", "avx512_bf16")

BANDWIDTH_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
int main(void) {
  const size_t n = (size_t)1 << 28;
  float* a = aligned_alloc(64, n * sizeof(float));
#pragma omp parallel for
  for (size_t i = 0; i < n; ++i) a[i] = 1.0f;
  double best = 0; float sink = 0;
  for (int rep = 0; rep < 9; ++rep) {
    double t = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
    {
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for nowait
      for (size_t i = 0; i < n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps(a + i));
        s1 = _mm256_add_ps(s1, _mm256_load_ps(a + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_load_ps(a + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_load_ps(a + i + 24));
      }
      float out[8];
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
      sink += out[0];
    }
    t = omp_get_wtime() - t;
    if (n * 4.0 / t / 1e9 > best) best = n * 4.0 / t / 1e9;
  }
  printf("%.2f %g\n", best, sink);
  return 0;
}
"""


def read_bandwidth_gbs() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "bw.c", Path(tmp) / "bw"
        src.write_text(BANDWIDTH_C)
        subprocess.run(["cc", "-O2", "-mavx2", "-fopenmp", str(src), "-o", str(exe)], check=True)
        return float(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()[0])


def isa() -> str:
    """The instruction set the compiled kernels run here (avx512_bf16, avx512 or avx2)."""
    from fastdeploy import ops
    return str(ops.runtime_info()["detected_isa"])


def add_isa_argument(parser: argparse.ArgumentParser) -> None:
    """--isa, shared by the scripts that run our kernels on a chosen instruction set (see use_isa)."""
    parser.add_argument("--isa", default="best", choices=ISA_CHOICES,
                        help="our kernels' instruction set (avx2 runs the AVX2 path on an AVX-512 CPU; "
                             "avx512: AVX-512 without the bf16 dot product)")


def use_isa(name: str) -> str:
    """Switch the compiled kernels to `name` (one of ISA_CHOICES) and return the one now active. Call it in
    the measuring process before the LLM is built: weights are packed for the active instruction set."""
    from fastdeploy import ops
    return ops.set_isa(name)


def decode_bytes_per_token(model, top_k: int, num_experts: int) -> int:
    """Weight bytes one decode step reads: every packed weight except the embedding's own table (a
    lookup reads one row), MoE experts weighted by top_k / E."""
    from fastdeploy.model_executor.layers.packed import packed_parameters

    head = model.lm_head.weight
    total = 0
    for w in packed_parameters(model):
        if w.role == "table" and w is not head:
            continue
        total += w.value.nbytes * (top_k / num_experts if w.experts else 1)
    return int(total) + sum(int(np.prod(p.shape)) * 4 for p in model.parameters())


def run_child(ckpt: str, fmt: str, workloads: list[str], kernels: str) -> dict:
    from fastdeploy import LLM, SamplingParams, ops
    from fastdeploy.model_executor.weight_format import weight_bytes

    use_isa(kernels)
    start = time.perf_counter()
    llm = LLM(model=ckpt, quantization=FORMATS[fmt], max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=2048, enable_chunked_prefill=True, enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    load_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    runner = llm.engine.runner
    hf = llm.config.model_config.hf_config
    # ERNIE-4.5's and Qwen3-MoE's names for the expert count and the experts per token
    experts = hf.get("moe_num_experts", hf.get("num_experts", 1))
    top_k = hf.get("moe_k", hf.get("num_experts_per_tok", 1))
    result = {"load_s": load_s, "load_peak_rss_gib": load_rss,
              "weights_gib": weight_bytes(runner.model) / 2**30,
              "kv_pool_gib": runner.num_blocks * runner.kv_block_bytes / 2**30,
              "decode_bytes_per_token": decode_bytes_per_token(runner.model, top_k, experts),
              "runtime": ops.runtime_info()}
    rng = np.random.default_rng(0)
    vocab = llm.config.model_config.vocab_size
    llm.generate([rng.integers(3, vocab, 16).tolist()], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                       detokenize=False), use_tqdm=False)
    for name in workloads:
        count, prompt_len, out_len = WORKLOADS[name]
        prompts = rng.integers(3, vocab, size=(count, prompt_len)).tolist()
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        entry = {"wall_s": wall, "output_tok_s": count * out_len / wall, "prompt_tok_s": count * prompt_len / wall}
        if name == "decode":
            m = outs[0].metrics
            decode_s = m.model_forward_time - m.first_token_time  # first -> last token (both from inference start)
            entry["decode_tok_s"] = (out_len - 1) / decode_s
        result[name] = entry
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def svg_plot(runs: list[dict], path: Path) -> None:
    """Horizontal grouped bars: decode / W16 / prompt tok/s per model and format, peak RSS as a label."""
    rows = [(f"{r['model']} {r['layers']}L {fmt}", res) for r in runs for fmt, res in r["results"].items()]
    metrics = [("decode", "decode_tok_s", "#1f77b4"), ("W16", "output_tok_s", "#ff7f0e"),
               ("prompt", "prompt_tok_s", "#2ca02c")]
    values = [res[name][key] for _, res in rows for name, key, _ in metrics if name in res]
    top = max(values) * 1.05
    left, width, bar, gap, upper = 230, 420, 11, 14, 30
    height = upper + len(rows) * (3 * bar + gap) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 140}" height="{height}" '
           f'font-family="sans-serif" font-size="12">', f'<rect width="100%" height="100%" fill="white"/>']
    for i, (name, key, color) in enumerate(metrics):
        out.append(f'<rect x="{left + 110 * i}" y="8" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + 110 * i + 14}" y="17">{name} tok/s</text>')
    y = upper
    for label, res in rows:
        out.append(f'<text x="{left - 8}" y="{y + 1.5 * bar + 4}" text-anchor="end">{label}</text>')
        for j, (name, key, color) in enumerate(metrics):
            if name in res:
                v = res[name][key]
                out.append(f'<rect x="{left}" y="{y + j * bar}" width="{v / top * width:.1f}" height="{bar - 1}" '
                           f'fill="{color}"/><text x="{left + v / top * width + 4:.1f}" y="{y + j * bar + 9}" '
                           f'font-size="10">{v:.1f}</text>')
        out.append(f'<text x="{left + width + 40}" y="{y + 1.5 * bar + 4}">{res["peak_rss_gib"]:.1f} GiB peak</text>')
        y += 3 * bar + gap
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="ernie-4.5-21b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="cut the model to its first N layers")
    parser.add_argument("--formats", default="bf16,wint8,wint4")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", type=Path, help="append the results here")
    parser.add_argument("--plot", type=Path, help="draw every run in --json into this SVG")
    add_isa_argument(parser)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        logging.disable(logging.WARNING)
        print(json.dumps(run_child(args.child[0], args.child[1], args.child[2].split(","), args.isa)))
        return

    for option, given, known in (("--workloads", args.workloads, WORKLOADS), ("--formats", args.formats, FORMATS)):
        unknown = [name for name in given.split(",") if name and name not in known]
        if unknown:
            parser.error(f"{option}: unknown {unknown}; choose from {list(known)}")
    shape = SHAPES[args.model]
    layers = args.layers or shape.layers
    ckpt = CACHE / f"{args.model}-{layers}l"
    write_checkpoint(ckpt, shape, layers)
    bandwidth = read_bandwidth_gbs()
    print(f"# {args.model}, {layers} of {shape.layers} layers; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {isa()}, kernels --isa {args.isa}; read bandwidth {bandwidth:.1f} GB/s",
          flush=True)
    results = {}
    for fmt in [f for f in args.formats.split(",") if f]:
        done = subprocess.run([sys.executable, __file__, "--child", str(ckpt), fmt, args.workloads,
                               "--isa", args.isa], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{fmt}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        bound = bandwidth * 1e9 / r["decode_bytes_per_token"]
        r["decode_bound_tok_s"] = bound
        results[fmt] = r
        line = (f"{fmt:6s} [{r['runtime']['active_isa']}] load {r['load_s']:6.1f} s  peak RSS "
                f"{r['peak_rss_gib']:5.2f} GiB (load {r['load_peak_rss_gib']:5.2f}; weights {r['weights_gib']:5.2f} + "
                f"KV {r['kv_pool_gib']:4.2f})")
        if "decode" in r:
            d = r["decode"]["decode_tok_s"]
            line += f"  decode {d:6.1f} tok/s ({100 * d / bound:3.0f}% of {bound:.1f})"
        if "W16" in r:
            line += f"  W16 {r['W16']['output_tok_s']:6.1f} tok/s"
        if "prompt" in r:
            line += f"  prompt {r['prompt']['prompt_tok_s']:6.1f} tok/s"
        print(line, flush=True)
    if args.json:
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        old.append({"model": args.model, "layers": layers, "isa": isa(), "kernels": args.isa,
                    "bandwidth_gbs": bandwidth, "results": results})
        args.json.write_text(json.dumps(old, indent=2))
        if args.plot:
            svg_plot(old, args.plot)


if __name__ == "__main__":
    main()
