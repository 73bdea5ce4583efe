"""Offline throughput of LLM.generate on an ERNIE-4.5-0.3B-shaped model with random weights.

    .venv/bin/python benchmarks/offline_throughput.py                      # every workload, every format
    .venv/bin/python benchmarks/offline_throughput.py --workloads decode,W16 --formats none
    .venv/bin/python benchmarks/offline_throughput.py --compare-hf --hf-python /path/to/python-with-torch

The checkpoint (hidden 1024, 18 layers, 16 q heads x 128, 2 kv heads, ffn 3072, vocab 103424, tied
embeddings; bf16 safetensors, ~0.7 GB) is written to benchmarks/.cache/ on first use. Workloads are
greedy with fixed lengths (no EOS): output tokens / total wall time, prefill included; TTFT is the
mean time from arrival to first token. --compare-hf runs transformers (torch, fp32) on the same
checkpoint and prompts in the same run and prints the ratio.
"""
from __future__ import annotations

import argparse
import json
import logging
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
WORKLOADS = {"decode": (1, 128, 128), "W16": (16, 128, 128), "W64": (64, 128, 128), "prefill": (8, 512, 1)}
FORMATS = {"none": None, "wint8": "wint8", "wint4": "wint4"}


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


def run_ours(fmt: str, workloads: list[str]) -> dict[str, dict[str, float]]:
    from fastdeploy import LLM, SamplingParams

    llm = LLM(model=str(CKPT), quantization=FORMATS[fmt], max_model_len=1024, max_num_seqs=64,
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
        ttft = np.mean([o.metrics.first_token_time - o.metrics.arrival_time for o in outputs])
        results[name] = {"output_tok_s": count * out_len / wall, "prompt_tok_s": count * prompt_len / wall,
                         "ttft_s": float(ttft), "wall_s": wall}
    return results


HF_SCRIPT = """
import json, sys, time, torch, numpy as np
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
print(json.dumps(results))
"""


def run_hf(python: str, workloads: list[str]) -> dict[str, dict[str, float]]:
    chosen = {name: WORKLOADS[name] for name in workloads}
    done = subprocess.run([python, "-c", HF_SCRIPT, str(CKPT), json.dumps(chosen)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {list(WORKLOADS)}")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {list(FORMATS)}")
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers on the same workloads")
    parser.add_argument("--hf-python", default=sys.executable, help="interpreter with torch + transformers")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    workloads = args.workloads.split(",")
    build_checkpoint()

    table = {}
    for fmt in args.formats.split(","):
        try:
            table[fmt] = run_ours(fmt, workloads)
        except NotImplementedError as e:
            print(f"{fmt}: not supported yet ({e})")
    if args.compare_hf:
        table["transformers fp32"] = run_hf(args.hf_python, workloads)

    print(f"\n{'format':<18} {'workload':<9} {'out tok/s':>10} {'prompt tok/s':>13} {'TTFT s':>8} {'wall s':>8}")
    for fmt, rows in table.items():
        for name, r in rows.items():
            print(f"{fmt:<18} {name:<9} {r['output_tok_s']:>10.1f} {r['prompt_tok_s']:>13.1f} "
                  f"{r.get('ttft_s', float('nan')):>8.2f} {r['wall_s']:>8.2f}")
    if "transformers fp32" in table and "none" in table:
        for name in workloads:
            ratio = table["none"][name]["output_tok_s"] / table["transformers fp32"][name]["output_tok_s"]
            print(f"ours (fp32 compute) / transformers, {name}: {ratio:.2f}x")
    print(f"peak memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
