"""Reference filtered distributions for tests/test_sampler.py, made with transformers' warpers.

Run with the reference interpreter (torch + transformers):
    /work/refvenv/bin/python tools/make_sampler_reference.py
Writes tests/fixtures/reference/sampler_distributions.json.
"""
import json
import pathlib

import numpy as np
import torch
import transformers
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/fixtures/reference/sampler_distributions.json"
rng = np.random.default_rng(1234)


def logits_row(vocab: int, ties: bool = False) -> list[float]:
    x = rng.normal(0.0, 1.5, vocab)
    if ties:
        x = np.round(x * 2) / 2  # many exactly equal logits
    return [float(v) for v in np.round(x, 4).astype(np.float32)]


def warp(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    # the order transformers' generate() uses, which is also the sampler's
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        procs.append(MinPLogitsWarper(min_p))
    scores = procs(None, torch.tensor([logits], dtype=torch.float32))
    return torch.softmax(scores, dim=-1)[0].tolist()


cases = []
for name, vocab, ties, params in [
    ("temperature", 16, False, dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)),
    ("hot", 16, False, dict(temperature=1.6, top_k=0, top_p=1.0, min_p=0.0)),
    ("top_k", 16, False, dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)),
    ("top_k_ties", 16, True, dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)),
    ("top_p", 16, False, dict(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0)),
    ("min_p", 16, False, dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.15)),
    ("temp_top_p", 24, False, dict(temperature=0.5, top_k=0, top_p=0.95, min_p=0.0)),
    ("all", 24, False, dict(temperature=1.5, top_k=9, top_p=0.9, min_p=0.08)),
    ("top_k_top_p", 24, False, dict(temperature=1.2, top_k=12, top_p=0.6, min_p=0.0)),
]:
    logits = logits_row(vocab, ties)
    cases.append(dict(name=name, logits=logits, **params, probs=warp(logits, **params)))

penalties = []
for penalty, prompt, output in [(1.3, [1, 3, 3, 7], [0, 7, 9, 9]), (0.8, [2, 5], [5, 11, 2, 14]), (2.0, [], [4])]:
    logits = logits_row(16)
    ids = torch.tensor([prompt + output], dtype=torch.long)
    processed = RepetitionPenaltyLogitsProcessor(penalty)(ids, torch.tensor([logits], dtype=torch.float32))
    penalties.append(dict(penalty=penalty, prompt=prompt, output=output, logits=logits, expected=processed[0].tolist()))

OUT.parent.mkdir(parents=True, exist_ok=True)
OUT.write_text(json.dumps({
    "generated_by": f"tools/make_sampler_reference.py, transformers {transformers.__version__}, torch {torch.__version__}",
    "filter_cases": cases,
    "repetition_penalty_cases": penalties,
}, indent=1) + "\n")
print(f"wrote {OUT}")
