"""What kv_cache_ratio changes on a mixed workload when the KV pool is the limit.

    .venv/bin/python benchmarks/kv_cache_ratio.py [--ratios 1.0,0.75,0.6] [--format wint4]

The 0.3B-shaped random checkpoint of offline_throughput.py (written on first use), 48 greedy requests with
prompts of 64 to 1024 tokens (a fixed random mix) and 192 output tokens each (no EOS), up to 16 running at once,
on a pool sized for about a third of them at full length (so prompts and growing outputs compete for blocks).
Per ratio, in its own process: preemptions, mean / p90 time to first token, output tokens/s, wall time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from offline_throughput import CKPT, FORMATS, build_checkpoint  # noqa: E402

NUM_REQUESTS, MAX_NUM_SEQS, OUTPUT_TOKENS, BLOCK_SIZE = 48, 16, 192, 64
PROMPT_LENGTHS = np.random.default_rng(0).integers(64, 1025, size=NUM_REQUESTS)
# A pool for about a third of the requests at full length: prompts and outputs compete for it.
NUM_BLOCKS = int(sum(-(-(int(n) + OUTPUT_TOKENS) // BLOCK_SIZE) for n in PROMPT_LENGTHS) / 3)


def run(ratio: float, fmt: str) -> dict[str, float]:
    import logging

    from fastdeploy import LLM, SamplingParams

    logging.getLogger("fastdeploy").setLevel(logging.WARNING)
    llm = LLM(model=str(CKPT), max_model_len=2048, max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=NUM_BLOCKS, kv_cache_ratio=ratio, quantization=FORMATS[fmt],
              enable_prefix_caching=False)
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(10, 50000, size=int(n)).tolist()} for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)  # warm up
    before = llm.engine.stats().num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - start
    ttft = np.array([o.metrics.inference_start_time + o.metrics.first_token_time - o.metrics.arrival_time
                     for o in outputs])
    return {"ratio": ratio, "preemptions": llm.engine.stats().num_preemptions - before,
            "ttft_mean_s": float(ttft.mean()), "ttft_p90_s": float(np.percentile(ttft, 90)),
            "output_tok_s": NUM_REQUESTS * OUTPUT_TOKENS / wall, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="1.0,0.75,0.6", help="comma list of kv_cache_ratio values")
    parser.add_argument("--format", default="wint4", choices=list(FORMATS))
    parser.add_argument("--child", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run(args.child, args.format)))
        return
    build_checkpoint()
    print(f"{NUM_REQUESTS} requests, prompts {PROMPT_LENGTHS.min()}-{PROMPT_LENGTHS.max()} tokens, {OUTPUT_TOKENS} "
          f"output tokens each, max_num_seqs {MAX_NUM_SEQS}, {NUM_BLOCKS} blocks of {BLOCK_SIZE}, {args.format}")
    print(f"{'kv_cache_ratio':>14} {'preemptions':>11} {'TTFT mean s':>11} {'TTFT p90 s':>10} {'out tok/s':>9} "
          f"{'wall s':>7}")
    for ratio in (float(r) for r in args.ratios.split(",")):
        child = subprocess.run([sys.executable, __file__, "--child", str(ratio), "--format", args.format],
                               check=True, capture_output=True, text=True)
        r = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"{r['ratio']:>14.2f} {r['preemptions']:>11d} {r['ttft_mean_s']:>11.2f} {r['ttft_p90_s']:>10.2f} "
              f"{r['output_tok_s']:>9.1f} {r['wall_s']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
