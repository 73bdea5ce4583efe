"""How closely bf16 compute, wint8 and wint4 follow the float32 model, greedy.

    .venv/bin/python benchmarks/quantization_agreement.py [--tokens 48]

For each model (the bundled demo model and the tiny test checkpoints) the engine with dtype="float32"
(the stored weights, every matmul in float32) writes a greedy continuation of each prompt; then for each
format (bf16: the default for these bf16 checkpoints, bf16 matmul inputs; wint8; wint4):
  free-running   the share of positions where the quantized engine's own greedy continuation has the
                 same token (once two continuations part they rarely meet again, so this compounds);
  teacher-forced the share of positions where, fed the unquantized continuation, the quantized model's
                 top-1 token is the unquantized one; and the mean |logprob difference| of that token.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from fastdeploy import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"demo (5.8M, trained)": ROOT / "models" / "ernie-4.5-demo",
          "ernie45_tiny (random)": ROOT / "tests" / "fixtures" / "models" / "ernie45_tiny_hf",
          "ernie45_moe_tiny (random)": ROOT / "tests" / "fixtures" / "models" / "ernie45_moe_tiny_hf",
          "qwen3_tiny (random)": ROOT / "tests" / "fixtures" / "models" / "qwen3_tiny"}
PROMPTS = ["The Python tutorial", "def main():", "import os\n", "A list is", "The sys module", "Exceptions are",
           "for i in range", "class Foo:"]


def continuations(llm: LLM, tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt token ids, greedy continuation) of each prompt."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.prompt_token_ids for o in outs], [o.outputs.token_ids for o in outs]


def forced(llm: LLM, prompts: list[list[int]], seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 tokens and the logprobs of the given tokens at every continuation position."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p + s} for p, s in zip(prompts, seqs)], params, use_tqdm=False)
    tops, logprobs = [], []
    for p, s, out in zip(prompts, seqs, outs):
        for i, token in enumerate(s):
            entry = out.prompt_logprobs[len(p) + i]
            tops.append(min(entry, key=lambda t: entry[t].rank))
            logprobs.append(entry[token].logprob)
    return np.array(tops), np.array(logprobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    args = parser.parse_args()
    logging.getLogger("fastdeploy").setLevel(logging.WARNING)
    print(f"{'model':<28} {'format':<7} {'free-running':>13} {'teacher-forced':>15} {'mean |dlogprob|':>16}")
    for label, path in MODELS.items():
        base = LLM(model=str(path), max_model_len=512, dtype="float32")
        prompts, seqs = continuations(base, args.tokens)
        want = np.concatenate(seqs)
        _, base_lp = forced(base, prompts, seqs)
        for quantization in (None, "wint8", "wint4"):
            llm = LLM(model=str(path), max_model_len=512, quantization=quantization)
            free = np.mean(np.concatenate(continuations(llm, args.tokens)[1]) == want)
            tops, lp = forced(llm, prompts, seqs)
            print(f"{label:<28} {quantization or 'bf16':<7} {free:>13.1%} {np.mean(tops == want):>15.1%} "
                  f"{np.mean(np.abs(lp - base_lp)):>16.4f}")


if __name__ == "__main__":
    main()
