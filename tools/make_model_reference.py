"""Record transformers' greedy outputs for the tiny ERNIE-4.5 checkpoint (the parity tests' reference).

    /work/refvenv/bin/python tools/make_model_reference.py

Needs torch + transformers (the reference venv), never the project's test suite. Loads
tests/fixtures/models/ernie45_tiny_hf with transformers' Ernie4_5ForCausalLM in float32 and, for
8 fixed prompts (token-id lists of lengths 1..130, crossing KV block sizes 16 and 64), greedily
generates exactly 24 tokens (no EOS stop; each step recomputes the whole sequence, no KV cache).
Per step it records the chosen token, its logprob (log_softmax of the float32 logits) and the top-5
(id, logprob). For two prompts it also records prompt logprobs: entry p (p >= 1) scores prompt token
p from position p - 1 (token, logprob, top-5); entry 0 is null. Then `bias_variant`: the same weights
with `use_bias` true and seeded random biases (recorded, by HF name) on every projection, greedy 12
tokens for two prompts, so the bias path is checked without another checkpoint fixture. Writes
tests/fixtures/reference/ernie45_tiny_greedy.json. Rerun after tools/make_tiny_models.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "tests" / "fixtures" / "models" / "ernie45_tiny_hf"
OUT_FILE = ROOT / "tests" / "fixtures" / "reference" / "ernie45_tiny_greedy.json"
PROMPT_LENGTHS = [1, 3, 8, 17, 31, 64, 65, 130]
PROMPT_LOGPROB_LENGTHS = {17, 65}
MAX_NEW_TOKENS = 24
TOP_K = 5
SEED = 0
BIAS_PROMPT_LENGTHS = [8, 31]
BIAS_NEW_TOKENS = 12


def top(logprobs: torch.Tensor, k: int = TOP_K) -> list[list[float | int]]:
    values, indices = torch.topk(logprobs, k)
    return [[int(i), float(v)] for i, v in zip(indices, values)]


@torch.no_grad()
def log_softmax_all(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[dict], float]:
    """Exactly max_new_tokens greedy tokens; returns (tokens, per-step records, smallest top-2 gap)."""
    tokens: list[int] = []
    steps: list[dict[str, object]] = []
    min_gap = float("inf")
    for _ in range(max_new_tokens):
        lp = log_softmax_all(model, prompt + tokens)[-1]
        best = top(lp)
        min_gap = min(min_gap, best[0][1] - best[1][1])
        token = best[0][0]
        steps.append({"token": token, "logprob": float(lp[token]), "top5": best})
        tokens.append(token)
    return tokens, steps, min_gap


@torch.no_grad()
def bias_variant(prompts: list[list[int]]) -> tuple[dict[str, object], float]:
    config = AutoConfig.from_pretrained(MODEL_DIR)
    config.use_bias = True
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, config=config, dtype=torch.float32)
    model.eval()
    rng = np.random.default_rng(SEED + 1)
    biases = {}
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            values = (rng.standard_normal(tuple(param.shape)) * 0.2).astype(np.float32)
            param.copy_(torch.from_numpy(values))
            biases[name] = values.tolist()
    cases, min_gap = [], float("inf")
    for prompt in prompts:
        tokens, steps, gap = greedy(model, prompt, BIAS_NEW_TOKENS)
        min_gap = min(min_gap, gap)
        cases.append({"prompt_token_ids": prompt, "output_token_ids": tokens, "steps": steps})
        print(f"bias variant, prompt len {len(prompt)}: {tokens}")
    return {"biases": biases, "cases": cases}, min_gap


def main() -> None:
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    model.eval()
    assert type(model).__name__ == "Ernie4_5ForCausalLM", type(model)

    rng = np.random.default_rng(SEED)
    cases, min_gap = [], float("inf")
    for n in PROMPT_LENGTHS:
        prompt = rng.integers(3, 1024, n).tolist()  # ids 0-2 are pad/bos/eos
        tokens, steps, gap = greedy(model, prompt, MAX_NEW_TOKENS)
        min_gap = min(min_gap, gap)
        case: dict[str, object] = {"prompt_token_ids": prompt, "output_token_ids": tokens, "steps": steps,
                                   "prompt_logprobs": None}
        if n in PROMPT_LOGPROB_LENGTHS:
            lp = log_softmax_all(model, prompt)
            case["prompt_logprobs"] = [None] + [
                {"token": prompt[p], "logprob": float(lp[p - 1, prompt[p]]), "top5": top(lp[p - 1])}
                for p in range(1, n)]
        cases.append(case)
        print(f"prompt len {n:3d}: {len(set(tokens))} distinct of {len(tokens)}: {tokens}")

    variant, gap = bias_variant([c["prompt_token_ids"] for c in cases
                                 if len(c["prompt_token_ids"]) in BIAS_PROMPT_LENGTHS])
    min_gap = min(min_gap, gap)
    print(f"smallest top-1/top-2 logprob gap: {min_gap:.4g}")
    if min_gap < 1e-3:
        raise SystemExit("a near tie would make the argmax comparison fragile: change the prompts' seed")
    OUT_FILE.parent.mkdir(parents=True, exist_ok=True)
    OUT_FILE.write_text(json.dumps({
        "generator": "tools/make_model_reference.py",
        "model": str(MODEL_DIR.relative_to(ROOT)),
        "reference": f"transformers {transformers.__version__} Ernie4_5ForCausalLM, torch {torch.__version__}, "
                     "float32, greedy, full recompute per step",
        "max_new_tokens": MAX_NEW_TOKENS,
        "top_k": TOP_K,
        "min_top2_gap": min_gap,
        "cases": cases,
        "bias_variant": variant,
    }, indent=1) + "\n")
    print(f"wrote {OUT_FILE}")


if __name__ == "__main__":
    main()
