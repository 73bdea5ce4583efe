"""A step's per-row sampling policy as arrays, from plain per-request values (the engine's step builder
passes each request's fields; nothing here sees a Request): the SamplingBatch with its greedy rows, drawn
uniforms and bans, and the per-row logprob transforms."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from fastdeploy.step_types import SamplingBatch, greedy_rows


class RowPolicy(Protocol):
    """What a row's sampling parameters give (SamplingParams, validated when the request was made)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    temp_scaled_logprobs: bool
    top_p_normalized_logprobs: bool


def banned_tokens(output_token_ids: Sequence[int], bad_words: Sequence[tuple[int, ...]], below_min_tokens: bool,
                  eos_token_ids: Iterable[int], stop_token_ids: Iterable[int] | None) -> list[int]:
    """Ids a row must not produce next: EOS and stop ids while it is below min_tokens, and the last token of
    every bad-word sequence whose other tokens end the output."""
    banned = []
    if below_min_tokens:
        banned.extend(eos_token_ids)
        banned.extend(stop_token_ids or ())
    if bad_words:
        output = output_token_ids
        for seq in bad_words:
            prefix = seq[:-1]
            if not prefix or (len(prefix) <= len(output) and tuple(output[len(output) - len(prefix):]) == prefix):
                banned.append(seq[-1])
    return banned


_POLICY_COLUMNS = (("temperature", np.float32), ("top_p", np.float32), ("top_k", np.int64), ("min_p", np.float32),
                   ("repetition_penalty", np.float32), ("frequency_penalty", np.float32),
                   ("presence_penalty", np.float32))


def sampling_batch(params: Sequence[RowPolicy], prompt_token_ids: list[Sequence[int]],
                   output_token_ids: list[Sequence[int]], banned_token_ids: list[list[int]],
                   generators: Sequence[np.random.Generator]) -> SamplingBatch:
    """The sampling rows, one per entry of each argument, with which rows are greedy and, where that is known
    here, whether their logits are untouched (nothing banned or penalised) and the step plain greedy. Each
    sampled (non-greedy) row draws its uniform from its own generator, so a seeded request's tokens never
    depend on the batch."""
    columns = {name: np.array([getattr(p, name) for p in params], dtype=dtype) for name, dtype in _POLICY_COLUMNS}
    greedy = greedy_rows(columns["temperature"], columns["top_p"], columns["top_k"])
    uniforms = np.zeros(len(params), dtype=np.float64)
    sampled_rows = np.flatnonzero(~greedy).tolist()
    for i in sampled_rows:
        uniforms[i] = generators[i].random()
    # Without penalties the answers are known here; with them they depend on each row's history.
    penalized = any(p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params)
    untouched = None if penalized else not any(banned_token_ids)
    return SamplingBatch(
        **columns, prompt_token_ids=prompt_token_ids, output_token_ids=output_token_ids,
        banned_token_ids=banned_token_ids, uniforms=uniforms, greedy=greedy,
        plain=None if penalized else untouched and not sampled_rows, untouched=untouched)


def logprob_transforms(params: Sequence[RowPolicy]) -> tuple[np.ndarray, np.ndarray]:
    """Per logprob row, the temperature to scale by and the top_p to renormalise to (1: off), as
    FastDeploy's temp_scaled_logprobs / top_p_normalized_logprobs. Temperature 0 (greedy) scales by 1."""
    temperature = [p.temperature if p.temp_scaled_logprobs and p.temperature else 1.0 for p in params]
    top_p = [p.top_p if p.top_p_normalized_logprobs else 1.0 for p in params]
    return np.asarray(temperature, dtype=np.float32), np.asarray(top_p, dtype=np.float32)
