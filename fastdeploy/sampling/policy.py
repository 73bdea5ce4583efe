"""A step's sampling policy as arrays, and the one rule for when the compiled forward draws the tokens itself.

The engine's step builder passes each sampling row's plain values (nothing here sees a Request) and gets the
SamplingBatch: per-row parameters, greedy rows, the uniform each sampled row drew from its own generator, bans.
`param_table` and `pack_token_ids` put a batch in the form the compiled sampling op (fd_sample) and the compiled
step both read. The runner asks `sample_in_forward` whether the step's tokens may be taken inside the compiled
forward call while the logits are in cache; when not, sampler.py's SamplingStage samples from the logits.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from fastdeploy.step_types import ModelRunnerOutput, SamplingBatch, SchedulerOutput, greedy_rows


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
                   uniform: Callable[[int], float]) -> SamplingBatch:
    """The sampling rows, one per entry of each argument, with which rows are greedy and, where that is known
    here, whether their logits are untouched (nothing banned or penalised) and the step plain greedy. Each
    sampled (non-greedy) row i gets its uniform from `uniform(i)` (its request's own draws), so a seeded
    request's tokens never depend on the batch."""
    columns = {name: np.array([getattr(p, name) for p in params], dtype=dtype) for name, dtype in _POLICY_COLUMNS}
    greedy = greedy_rows(columns["temperature"], columns["top_p"], columns["top_k"])
    uniforms = np.zeros(len(params), dtype=np.float64)
    sampled_rows = np.flatnonzero(~greedy).tolist()
    for i in sampled_rows:
        uniforms[i] = uniform(i)
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


# ---- the batch as the compiled sampling op reads it -------------------------------------------------------
# Columns of the op's float64 parameter table, in fd::SampleCol order (custom_ops/fd_kernels.h), with the dtype
# each value has first (as the numpy sampler holds it): float64 represents them all exactly.
PARAM_COLUMNS = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int64, "min_p": np.float32,
                 "repetition_penalty": np.float32, "frequency_penalty": np.float32,
                 "presence_penalty": np.float32, "uniforms": np.float64, "greedy": bool}


def param_table(batch: SamplingBatch, greedy: np.ndarray) -> np.ndarray:
    """The op's float64 parameter table [B, len(PARAM_COLUMNS)] of a batch whose greedy rows are `greedy`."""
    return np.column_stack([greedy if name == "greedy" else getattr(batch, name) for name in PARAM_COLUMNS]
                           ).astype(np.float64, copy=False)


def pack_token_ids(batch: SamplingBatch, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The token lists the op reads, as (ids, offsets) int64: row r's banned ids are ids[offsets[3r]:
    offsets[3r + 1]], then its prompt ids up to offsets[3r + 2], then its output ids up to offsets[3r + 3].
    Lists a row's parameters do not use are left empty (and unchecked, as in the numpy path)."""
    n_rows = len(batch.banned_token_ids)
    rep = batch.repetition_penalty != 1
    needs_output = rep | (batch.frequency_penalty != 0) | (batch.presence_penalty != 0)
    lists: list[Sequence[int]] = []
    for r in range(n_rows):
        lists += (batch.banned_token_ids[r], batch.prompt_token_ids[r] if rep[r] else (),
                  batch.output_token_ids[r] if needs_output[r] else ())
    lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    if any(isinstance(t, np.ndarray) for t in lists):  # e.g. prompts kept as arrays: no per-id Python work
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in lists])
    else:
        ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(offsets[-1]))
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():  # name the first kind of list (banned, prompt, output) that holds a bad id
        kind = int(np.repeat(np.tile(np.arange(3), n_rows), lens)[bad].min())
        name = ("banned_token_ids", "prompt_token_ids", "output_token_ids")[kind]
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size})")
    return ids, offsets


# ---- the fast path ----------------------------------------------------------------------------------------
def sampler_alone(step: SchedulerOutput) -> bool:
    """Nothing but the sampler reads the step's logits: every logit row samples (no prompt-logprob rows) and
    no row has a grammar mask, a logit bias or logprobs to report. engine/step_builder.py's SteadyDecode keeps
    a decoding step for reuse only when this holds too."""
    return (len(step.forward.logit_rows) == step.num_samples and not len(step.guided_rows)
            and not len(step.bias_rows) and not len(step.logprob_rows))


class InForward(NamedTuple):
    """How the compiled step takes the tokens inside its forward call: a bare argmax (both None), or the
    sampling op's draw with its parameter table `params` and its `token_lists` (the 3B + 1 offsets, then the
    ids; None: every list empty)."""

    params: np.ndarray | None
    token_lists: np.ndarray | None


_ARGMAX = InForward(None, None)  # made once: the one-stream greedy decode step allocates nothing here


def sample_in_forward(step: SchedulerOutput, vocab_size: int) -> InForward | None:
    """Whether (and how) the step's tokens may be taken inside the compiled forward call, while the logits
    are in cache: whenever nothing but the sampler reads them (`sampler_alone`); None otherwise. Forced
    tokens are put in afterwards either way (`sampled_in_forward`). Whether the compiled step runs the
    forward at all is the runner's (CompiledDecoder.covers)."""
    if not step.num_samples or not sampler_alone(step):
        return None
    sampling = step.sampling
    if sampling.plain_greedy():
        return _ARGMAX
    table = param_table(sampling, sampling.greedy_mask())
    if sampling.untouched_logits():
        return InForward(table, None)
    ids, offsets = pack_token_ids(sampling, vocab_size)
    return InForward(table, np.concatenate([offsets, ids]))


def with_forced_tokens(tokens: list[int], step: SchedulerOutput) -> list[int]:
    """The sampled tokens with the forced ones put in their rows."""
    if not len(step.forced_token_ids):
        return tokens
    return [f if f >= 0 else t for f, t in zip(step.forced_token_ids.tolist(), tokens)]


def sampled_in_forward(step: SchedulerOutput, tokens: list[int], how: InForward) -> ModelRunnerOutput:
    """The output of a step whose `tokens` the compiled forward call took as `how` (sample_in_forward's answer)
    said; -1 marks a sampled row without a finite largest logit."""
    if how.params is not None and -1 in tokens:
        raise ValueError(f"logits of row {tokens.index(-1)} are all -inf or hold NaN/inf")
    return ModelRunnerOutput(with_forced_tokens(tokens, step))
