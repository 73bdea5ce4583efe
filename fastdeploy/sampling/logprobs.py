"""Log-probabilities of a step's rows, as the runner reports them (ModelRunnerOutput.logprobs and
prompt_logprobs): exact numpy log-softmax, the k best entries and the target's rank, FastDeploy's
temperature-scaled / top-p-renormalised variants, and which logits each row's entries come from
(logprobs_mode)."""
from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.ops.token_bitmask import logits_view
from fastdeploy.sampling.reference import processed_logits
from fastdeploy.step_types import SchedulerOutput, TopLogprobs


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of log-probabilities in the logits' dtype, exact down to -inf (a token the grammar disallows).
    Not Paddle's CPU log_softmax: that one floors every value at about -64."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(shifted.dtype)


def top_logprobs(logp: np.ndarray, k: int, target: int) -> TopLogprobs:
    """The k best entries of one row of log-probabilities (k=-1: all), and the target's logprob and rank."""
    vocab = logp.shape[-1]
    k = vocab if k == -1 else min(k, vocab)
    top = np.argpartition(-logp, k - 1)[:k] if 0 < k < vocab else np.arange(k)
    top = top[np.argsort(-logp[top], kind="stable")]
    rank = int((logp > logp[target]).sum()) + 1
    return TopLogprobs(top, logp[top], float(logp[target]), rank)


def transformed_logprobs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """One row's log-probabilities as FastDeploy's temp_scaled_logprobs / top_p_normalized_logprobs give
    them: logits divided by temperature, then (top_p < 1) the distribution cut to its top_p nucleus (the
    tokens whose better-ranked mass is <= top_p) and renormalised. Tokens outside get the float32 minimum,
    as FastDeploy clips them."""
    logp = log_softmax(logits.astype(np.float64) / temperature)
    if top_p < 1.0:
        order = np.argsort(-logp, kind="stable")
        probs = np.exp(logp[order])
        keep = order[(np.cumsum(probs) - probs) <= top_p]
        kept = np.full_like(logp, -np.inf)
        kept[keep] = log_softmax(logp[keep])
        logp = kept
    return np.maximum(logp, np.finfo(np.float32).min).astype(np.float32)


def step_logprobs(step: SchedulerOutput, logits: paddle.Tensor, sampled_from: paddle.Tensor | np.ndarray | None,
                  thresholds: np.ndarray | None, tokens: list[int],
                  logprobs_mode: str) -> tuple[list[TopLogprobs], list[TopLogprobs]]:
    """The entries of the sampling rows asking for logprobs and of the prompt rows, as `logprobs_mode` says:
    raw (the model's logits; a grammar's mask included, as in vLLM) or, for sampling rows, processed (what
    the sampler drew from: `sampled_from` with bans, penalties, temperature and the rows' `thresholds`,
    which the caller asks the sampler for exactly when the mode is processed); prompt rows are always raw
    (nothing processes a prompt position)."""
    raw = logits_view(logits)  # no copy
    if thresholds is not None:
        sample = processed_logits(logits_view(sampled_from), step.sampling, step.logprob_rows, thresholds)
    else:
        sample = raw[step.logprob_rows]
    prompt = raw[step.num_samples + np.arange(len(step.prompt_logprob_k))]
    if logprobs_mode.endswith("logprobs"):
        sample, prompt = log_softmax(sample), log_softmax(prompt)
    for i, (j, t, p) in enumerate(zip(step.logprob_rows, step.logprob_temperature, step.logprob_top_p)):
        if t != 1.0 or p < 1.0:  # temp_scaled_logprobs / top_p_normalized_logprobs (raw_logprobs only)
            sample[i] = transformed_logprobs(raw[j], float(t), float(p))
    return ([top_logprobs(sample[i], int(k), int(tokens[j]))
             for i, (j, k) in enumerate(zip(step.logprob_rows, step.logprob_k))],
            [top_logprobs(prompt[i], int(k), int(target))
             for i, (k, target) in enumerate(zip(step.prompt_logprob_k, step.prompt_logprob_targets))])
