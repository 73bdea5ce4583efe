"""Offline throughput of LLM.generate on an ERNIE-4.5-0.3B-shaped model with random weights.

    .venv/bin/python benchmarks/offline_throughput.py                      # every workload, every format
    .venv/bin/python benchmarks/offline_throughput.py --workloads decode,W16 --formats bf16
    .venv/bin/python benchmarks/offline_throughput.py --compare-hf --hf-python /path/to/python-with-torch \
        --json results.json --plot docs/benchmarks.svg

The checkpoint (hidden 1024, 18 layers, 16 q heads x 128, 2 kv heads, ffn 3072, vocab 103424, tied
embeddings; bf16 safetensors, ~0.7 GB) is written to benchmarks/.cache/ on first use. Formats: "bf16"
(the checkpoint's bf16 weights as stored, bf16 matmul inputs), "wint8", "wint4" (LLM(quantization=...));
--kv-cache block_wise_fp8 adds kv_cache_quant_type to each (the format's label gets "+fp8kv").
Workloads are greedy with fixed lengths (no EOS): output tokens / total wall time, prefill included;
TTFT is the mean time from arrival to first token. Each format (and transformers) runs in its own
process, so the peak memory printed is that run's. --compare-hf runs transformers (torch, fp32) on
the same checkpoint and prompts in the same run and prints our ratio to it.
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
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from make_tiny_models import BASE_CONFIG, Shape, Weights, copy_tokenizer, write_json, write_safetensors  # noqa: E402

CKPT = ROOT / "benchmarks" / ".cache" / "ernie45-0.3b-random"
SHAPE = Shape(vocab=103424, hidden=1024, layers=18, heads=16, kv_heads=2, head_dim=128, ffn=3072)
# name: (number of prompts, prompt tokens, output tokens)
WORKLOADS = {"decode": (1, 128, 128), "W4": (4, 128, 128), "W16": (16, 128, 128), "W64": (64, 128, 128),
             "prefill": (8, 512, 1), "long16": (16, 1920, 128)}
DEFAULT_WORKLOADS = "decode,W4,W16,W64,prefill"  # long16 (decode over long contexts: KV-bound) on request
KV_CACHES = ("auto", "block_wise_fp8")
FORMATS = {"bf16": None, "wint8": "wint8", "wint4": "wint4"}
HF = "transformers fp32"


def build_checkpoint() -> None:
    if (CKPT / "model.safetensors").exists():
        return
    CKPT.mkdir(parents=True, exist_ok=True)
    print(f"writing the random 0.3B-shaped checkpoint to {CKPT} ...", flush=True)
    w = Weights(np.random.default_rng(0), proj_std=0.02)
    tensors = w.decoder(SHAPE, lambda p, i: w.mlp(p, SHAPE.hidden, SHAPE.ffn), embed_std=0.02)
    write_safetensors(CKPT / "model.safetensors", tensors, "BF16")
    config = dict(BASE_CONFIG, architectures=["Ernie4_5ForCausalLM"], hidden_size=SHAPE.hidden,
                  intermediate_size=SHAPE.ffn, num_attention_heads=SHAPE.heads, num_key_value_heads=SHAPE.kv_heads,
                  head_dim=SHAPE.head_dim, num_hidden_layers=SHAPE.layers, vocab_size=SHAPE.vocab,
                  rope_theta=500000.0, torch_dtype="bfloat16")
    write_json(CKPT / "config.json", config)
    copy_tokenizer(CKPT)  # token ids beyond its vocabulary are never decoded: detokenize=False


def make_prompts(count: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(count * 1000 + length)
    return rng.integers(3, SHAPE.vocab, size=(count, length)).tolist()


def run_ours(fmt: str, workloads: list[str], kv_cache: str) -> dict[str, dict[str, float]]:
    from fastdeploy import LLM, SamplingParams

    quantization = FORMATS[fmt]
    if kv_cache != "auto":
        quantization = {"kv_cache_quant_type": kv_cache} | ({"quantization": quantization} if quantization else {})
    llm = LLM(model=str(CKPT), quantization=quantization, max_model_len=2048, max_num_seqs=64,
              max_num_batched_tokens=4096, enable_chunked_prefill=True, enable_prefix_caching=False)
    llm.generate(make_prompts(2, 16), SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
                 use_tqdm=False)  # warm-up
    results = {}
    for name in workloads:
        count, prompt_len, out_len = WORKLOADS[name]
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(make_prompts(count, prompt_len), params, use_tqdm=False)
        wall = time.perf_counter() - start
        end = time.time()
        first = [o.metrics.inference_start_time + o.metrics.first_token_time for o in outputs]
        ttft = np.mean([f - o.metrics.arrival_time for f, o in zip(first, outputs)])
        # decode alone: the tokens after every request's first one, over the time after the last first token
        results[name] = {"output_tok_s": count * out_len / wall, "prompt_tok_s": count * prompt_len / wall,
                         "decode_tok_s": count * (out_len - 1) / max(end - max(first), 1e-9),
                         "ttft_s": float(ttft), "wall_s": wall}
    return results


HF_SCRIPT = """
import json, resource, sys, time, torch, numpy as np
from transformers import AutoModelForCausalLM
torch.set_num_threads(2)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
results = {}
for name, (count, prompt_len, out_len) in json.loads(sys.argv[2]).items():
    rng = np.random.default_rng(count * 1000 + prompt_len)
    ids = torch.tensor(rng.integers(3, model.config.vocab_size, size=(count, prompt_len)))
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                       do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - start
    results[name] = {"output_tok_s": count * out_len / wall, "prompt_tok_s": count * prompt_len / wall, "wall_s": wall}
results["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(results))
"""


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_isolated(args: list[str]) -> dict:
    """Run this script (or the transformers snippet) in a child process; its last stdout line is JSON."""
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} ... failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def svg_plot(table: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    """Output tokens/s against the number of concurrent prompts (the decode/W* workloads), one line per
    format, as a small self-contained SVG (no plotting library needed)."""
    batch = {name: WORKLOADS[name][0] for name in WORKLOADS if name == "decode" or name.startswith("W")}
    series = {fmt: [(batch[n], r[n]["output_tok_s"]) for n in batch if n in r] for fmt, r in table.items()}
    series = {k: v for k, v in series.items() if v}
    xs = sorted({b for pts in series.values() for b, _ in pts})
    top = max(v for pts in series.values() for _, v in pts) * 1.1
    w, h, left, bottom, right, upper = 640, 400, 60, 50, 150, 20
    px = {b: left + i * (w - left - right) / max(len(xs) - 1, 1) for i, b in enumerate(xs)}

    def py(v: float) -> float:
        return h - bottom - v / top * (h - bottom - upper)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{upper}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
           f'<text x="{(left + w - right) / 2}" y="{h - 10}" text-anchor="middle">concurrent prompts '
           f'(128 prompt + 128 output tokens each)</text>',
           f'<text x="15" y="{(h - bottom + upper) / 2}" transform="rotate(-90 15 {(h - bottom + upper) / 2})" '
           f'text-anchor="middle">output tokens/s</text>']
    for b in xs:
        out.append(f'<text x="{px[b]}" y="{h - bottom + 18}" text-anchor="middle">{b}</text>')
    step = 10 ** int(np.floor(np.log10(top / 2)))
    for v in np.arange(0, top, step * (2 if top / step > 10 else 1)):
        out.append(f'<text x="{left - 6}" y="{py(v) + 4}" text-anchor="end">{v:g}</text>')
        out.append(f'<line x1="{left}" y1="{py(v)}" x2="{w - right}" y2="{py(v)}" stroke="#ddd"/>')
    for i, (fmt, pts) in enumerate(series.items()):
        color = colors[i % len(colors)]
        coords = " ".join(f"{px[b]:.1f},{py(v):.1f}" for b, v in pts)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.extend(f'<circle cx="{px[b]:.1f}" cy="{py(v):.1f}" r="3" fill="{color}"/>' for b, v in pts)
        out.append(f'<text x="{w - right + 10}" y="{upper + 20 + 18 * i}" fill="{color}">{fmt}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def print_table(table: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"\n{'format':<18} {'workload':<9} {'out tok/s':>10} {'prompt tok/s':>13} {'decode tok/s':>13} {'TTFT s':>8} "
          f"{'wall s':>8}")
    for fmt, rows in table.items():
        for name, r in rows.items():
            if name in WORKLOADS:
                print(f"{fmt:<18} {name:<9} {r['output_tok_s']:>10.1f} {r['prompt_tok_s']:>13.1f} "
                      f"{r.get('decode_tok_s', float('nan')):>13.1f} {r.get('ttft_s', float('nan')):>8.2f} "
                      f"{r['wall_s']:>8.2f}")
        print(f"{fmt:<18} peak memory {rows['peak_rss_gib']:.2f} GiB")
    if HF in table:
        for fmt in (f for f in table if f != HF):
            ratios = ", ".join(f"{n} {table[fmt][n]['output_tok_s'] / table[HF][n]['output_tok_s']:.2f}x"
                               for n in WORKLOADS if n in table[fmt] and n in table[HF])
            print(f"{fmt} / transformers: {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, help=f"comma list of {list(WORKLOADS)}")
    parser.add_argument("--kv-cache", choices=KV_CACHES, default="auto", help="the KV cache's format")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {list(FORMATS)}")
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers on the same workloads")
    parser.add_argument("--hf-python", default=sys.executable, help="interpreter with torch + transformers")
    parser.add_argument("--hf-workloads", help="workloads for transformers (default: --workloads; its W64 "
                        "takes over 25 minutes here)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write an SVG plot of tokens/s by batch size and format here")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one format, print JSON
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    formats = [f for f in args.formats.split(",") if f]  # --formats "" with --compare-hf: transformers only
    unknown = [w for w in workloads if w not in WORKLOADS] + [f for f in formats if f not in FORMATS]
    if unknown:
        parser.error(f"unknown workloads/formats {unknown}")
    if args.child:
        logging.getLogger("fastdeploy").setLevel(logging.WARNING)
        results = run_ours(args.child, workloads, args.kv_cache)
        print(json.dumps({**results, "peak_rss_gib": peak_rss_gib()}))
        return
    build_checkpoint()

    table = {}
    for fmt in formats:
        label = fmt + ("+fp8kv" if args.kv_cache == "block_wise_fp8" else "")
        table[label] = run_isolated([sys.executable, __file__, "--child", fmt, "--workloads", args.workloads,
                                     "--kv-cache", args.kv_cache])
        print(f"{label}: " + ", ".join(f"{n} {table[label][n]['output_tok_s']:.1f} tok/s" for n in workloads),
              flush=True)
    if args.compare_hf:
        chosen = {name: WORKLOADS[name] for name in (args.hf_workloads or args.workloads).split(",")}
        table[HF] = run_isolated([args.hf_python, "-c", HF_SCRIPT, str(CKPT), json.dumps(chosen)])
    print_table(table)
    if args.json:
        machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                   "date": time.strftime("%Y-%m-%d %H:%M")}
        args.json.write_text(json.dumps({"machine": machine, "results": table}, indent=1) + "\n")
    if args.plot:
        svg_plot(table, args.plot)


if __name__ == "__main__":
    main()
