"""Token sampling for a step's logits: bans, penalties, greedy argmax or temperature / top-k / top-p /
min-p and an inverse-CDF draw, for the whole batch in one call of the compiled op `fd_sample`
(custom_ops/kern_sampling.inc); and the runner's SamplingStage around it (grammar masks, logit bias, forced
tokens, logprobs) for the steps whose tokens the compiled forward did not take (policy.sample_in_forward).

The semantics are the numpy sampler's (fastdeploy/sampling/reference.py), its reference. Each sampled
row comes with its uniform (drawn by the caller from the row's own generator), so a row's token never
depends on the rest of the batch.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import paddle

from fastdeploy.ops.build import call_op, compiled
from fastdeploy.ops.token_bitmask import apply_token_bitmask_
from fastdeploy.sampling.filters import Scratch
from fastdeploy.sampling.logprobs import step_logprobs
from fastdeploy.sampling.policy import PARAM_COLUMNS, pack_token_ids, param_table, with_forced_tokens
from fastdeploy.sampling.reference import sample_numpy
from fastdeploy.step_types import ModelRunnerOutput, SamplingBatch, SchedulerOutput

_COLUMN = {name: j for j, name in enumerate(PARAM_COLUMNS)}
_TOKEN_LISTS = ("banned_token_ids", "prompt_token_ids", "output_token_ids")
# What the kernel needs of the sampled rows' values to mean anything (`sample` checks them; the
# Sampler trusts its batch).
_SAMPLED_ROW_CHECKS = (
    ("uniforms", lambda u: (u >= 0) & (u < 1), "in [0, 1)"),
    ("temperature", lambda t: t > 0, "> 0"),
    ("top_p", lambda p: p <= 1, "<= 1"),
    ("min_p", lambda p: p <= 1, "<= 1"),
)


def _check(logits: paddle.Tensor | np.ndarray, params: dict[str, object], token_ids: np.ndarray,
           token_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checked inputs: the float64 parameter table [B, len(PARAM_COLUMNS)], the ids, the offsets."""
    shape = tuple(logits.shape)
    if len(shape) != 2 or shape[1] == 0:
        raise ValueError(f"logits must have shape [batch, vocab], got {list(shape)}")
    if logits.dtype != (paddle.float32 if isinstance(logits, paddle.Tensor) else np.float32):
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    n_rows, vocab = shape
    table = np.empty((n_rows, len(PARAM_COLUMNS)), dtype=np.float64)
    for j, (name, dtype) in enumerate(PARAM_COLUMNS.items()):
        a = np.asarray(params[name])
        if a.shape != (n_rows,):
            raise ValueError(f"{name} must have shape ({n_rows},) to match the logits, got {a.shape}")
        table[:, j] = a.astype(dtype, copy=False)
    ids = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(-1)
    offsets = np.ascontiguousarray(token_offsets, dtype=np.int64).reshape(-1)
    if offsets.shape != (3 * n_rows + 1,) or offsets[0] != 0 or offsets[-1] != ids.size or (np.diff(offsets) < 0).any():
        raise ValueError(f"token_offsets must be {3 * n_rows + 1} non-decreasing offsets from 0 to len(token_ids)")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token_ids must be in [0, {vocab})")
    sampled = table[table[:, _COLUMN["greedy"]] == 0]
    for name, ok, allowed in _SAMPLED_ROW_CHECKS:
        if not ok(sampled[:, _COLUMN[name]]).all():
            raise ValueError(f"{name} of sampled rows must be {allowed}")
    return table, ids, offsets


def sample_reference(logits: paddle.Tensor | np.ndarray, *, greedy: np.ndarray, uniforms: np.ndarray,
                     temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                     repetition_penalty: np.ndarray, frequency_penalty: np.ndarray,
                     presence_penalty: np.ndarray, token_ids: np.ndarray, token_offsets: np.ndarray,
                     return_thresholds: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """`sample` by the numpy sampler (fastdeploy.sampling.reference.sample_numpy)."""
    params = dict(greedy=greedy, uniforms=uniforms, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                  presence_penalty=presence_penalty)
    table, ids, offsets = _check(logits, params, token_ids, token_offsets)
    n_rows = table.shape[0]
    rows = {name: table[:, j].astype(dtype) for j, (name, dtype) in enumerate(PARAM_COLUMNS.items())}
    segments = np.split(ids, offsets[1:-1])
    batch = SamplingBatch(
        temperature=rows["temperature"], top_p=rows["top_p"], top_k=rows["top_k"], min_p=rows["min_p"],
        repetition_penalty=rows["repetition_penalty"], frequency_penalty=rows["frequency_penalty"],
        presence_penalty=rows["presence_penalty"], uniforms=rows["uniforms"],
        **{name: segments[k::3] for k, name in enumerate(_TOKEN_LISTS)})
    view = logits.numpy() if isinstance(logits, paddle.Tensor) else np.asarray(logits)
    thresholds = np.full(n_rows, np.nan, dtype=np.float32)
    tokens = sample_numpy(view, batch, rows["greedy"], rows["uniforms"], thresholds=thresholds)
    return (tokens, thresholds) if return_thresholds else tokens


def sample(logits: paddle.Tensor | np.ndarray, *, greedy: np.ndarray, uniforms: np.ndarray,
           temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
           repetition_penalty: np.ndarray, frequency_penalty: np.ndarray, presence_penalty: np.ndarray,
           token_ids: np.ndarray, token_offsets: np.ndarray, return_thresholds: bool = False,
           use_compiled: bool = True) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """One token per row of the float32 logits [B, V] (not modified) -> int64 [B].

    Per row (arrays of B values): `greedy` rows take the argmax after bans and penalties; the others
    are divided by `temperature`, filtered by `top_k` (0/-1 off), `top_p` (1 off; renormalised after
    top-k) and `min_p` (0 off), and draw the token where the CDF of the kept exp(logit - max), in token
    order, passes `uniforms` (float64 in [0, 1)). Token lists are CSR: row r's banned ids are
    token_ids[token_offsets[3r]:token_offsets[3r + 1]], its prompt ids follow up to token_offsets[3r + 2]
    and its output ids up to token_offsets[3r + 3]; repetition_penalty covers prompt + output ids (each
    distinct id once), frequency / presence the output ids. Raises ValueError when a sampled row has
    no finite largest logit. With `return_thresholds`, also float32 [B]: each sampled row kept the
    tokens with logit / temperature >= its value (-inf: all); NaN for greedy rows.
    """
    lib = compiled(use_compiled)
    params = dict(greedy=greedy, uniforms=uniforms, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                  presence_penalty=presence_penalty)
    if lib is None:
        return sample_reference(logits, token_ids=token_ids, token_offsets=token_offsets,
                                return_thresholds=return_thresholds, **params)
    table, ids, offsets = _check(logits, params, token_ids, token_offsets)
    return _run(lib, logits, table, ids, offsets, return_thresholds)


def _run(lib: object, logits: paddle.Tensor | np.ndarray, table: np.ndarray, ids: np.ndarray, offsets: np.ndarray,
         return_thresholds: bool) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    if not isinstance(logits, paddle.Tensor) or not logits.place.is_cpu_place() or not logits.is_contiguous():
        logits = paddle.from_dlpack(np.ascontiguousarray(np.asarray(logits)))  # zero-copy for numpy arrays
    # Offsets and ids travel as one tensor: wrapping each array in a tensor costs ~8 us.
    tokens, thresholds = call_op(lib, "fd_sample", logits, paddle.from_dlpack(np.concatenate([offsets, ids])),
                                 paddle.from_dlpack(table))
    tokens = tokens.numpy()
    if tokens.size and tokens.min() < 0:  # -1: a sampled row without a finite largest logit
        raise ValueError(f"logits of row {int(np.argmax(tokens < 0))} are all -inf or hold NaN/inf")
    return (tokens, thresholds.numpy()) if return_thresholds else tokens


def _as_array(logits: paddle.Tensor | np.ndarray) -> np.ndarray:
    """A float32 [B, V] array over the logits, zero-copy where possible. Never written to: the
    caller's logits stay as they were (the runner may still want their raw values)."""
    if isinstance(logits, np.ndarray):
        x = np.asarray(logits, dtype=np.float32)
    elif isinstance(logits, paddle.Tensor):
        if logits.dtype != paddle.float32:
            logits = logits.astype("float32")
        try:
            x = np.from_dlpack(logits)  # shares the tensor's CPU memory
        except (BufferError, RuntimeError, TypeError, ValueError):
            x = logits.numpy()  # e.g. a GPU tensor: copy to host
    else:
        raise TypeError(f"logits must be a paddle.Tensor or numpy array, got {type(logits).__name__}")
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logits must have shape [batch, vocab], got {list(x.shape)}")
    return x


class Sampler:
    """Samples a SamplingBatch from logits: the compiled op when built (and `use_compiled`), else the
    numpy sampler. The batch's values are trusted: SamplingParams validated them."""

    def __init__(self, use_compiled: bool = True) -> None:
        self.use_compiled = use_compiled
        self._scratch = Scratch()

    def __call__(self, logits: paddle.Tensor | np.ndarray, batch: SamplingBatch,
                 thresholds: np.ndarray | None = None) -> np.ndarray:
        """One token per row. `thresholds` (float32 [B]), if given, receives each sampled row's filter
        threshold (it kept logit / temperature >= it) and NaN for greedy rows."""
        view = _as_array(logits)
        if len(batch) != view.shape[0]:
            raise ValueError(f"the batch has {len(batch)} rows (temperature, top_p, ...) but the logits have "
                             f"{view.shape[0]}")
        if thresholds is not None:
            thresholds[:] = np.nan
        if batch.plain_greedy():
            # Plain argmax: numpy's takes the first maximum and the first NaN, as the op's greedy rows do,
            # without the op's ~0.2 ms of argument packing per step.
            return np.argmax(view, axis=1).astype(np.int64)
        greedy = batch.greedy_mask()
        lib = compiled(self.use_compiled)
        if lib is None:
            return sample_numpy(view, batch, greedy, batch.uniforms, self._scratch, thresholds)
        table = param_table(batch, greedy)
        ids, offsets = pack_token_ids(batch, view.shape[1])
        # A float32 paddle tensor goes to the op as it is: wrapping the numpy view again costs time.
        as_is = isinstance(logits, paddle.Tensor) and logits.dtype == paddle.float32
        if thresholds is None:
            return _run(lib, logits if as_is else view, table, ids, offsets, False)
        tokens, thresholds[:] = _run(lib, logits if as_is else view, table, ids, offsets, True)
        return tokens


def with_logit_bias(logits: paddle.Tensor, step: SchedulerOutput) -> paddle.Tensor | np.ndarray:
    """The sampler's input: logits plus each row's logit_bias (before penalties, as vLLM does); the raw
    logits stay untouched for logprobs."""
    if not len(step.bias_rows):
        return logits
    biased = np.array(logits.numpy(), copy=True)
    biased[step.bias_rows, step.bias_token_ids] += step.bias_values
    return biased


class SamplingStage:
    """Turns a forwarded step into its ModelRunnerOutput. Holds the sampler (the compiled op, or the numpy
    sampler without it) and the engine's logprobs_mode."""

    def __init__(self, logprobs_mode: str) -> None:
        self.logprobs_mode = logprobs_mode
        self.sampler = Sampler()

    def __call__(self, step: SchedulerOutput, logits: paddle.Tensor | None,
                 wait_for_masks: Callable[[], object] | None = None) -> ModelRunnerOutput:
        """Sample the step from its logits [S + P, vocab] (None: no row needs them). `wait_for_masks`: returns
        once step.token_bitmask is filled (the engine computes the grammar masks while the forward runs)."""
        num_samples = step.num_samples
        tokens: list[int] = []
        if len(step.guided_rows):
            if wait_for_masks is not None:
                wait_for_masks()
            apply_token_bitmask_(logits, step.guided_rows, step.token_bitmask)
        sampled_from, thresholds = None, None
        if num_samples:
            sampled_from = with_logit_bias(logits[:num_samples], step)
            if self.logprobs_mode.startswith("processed") and len(step.logprob_rows):
                thresholds = np.empty(num_samples, dtype=np.float32)
            tokens = with_forced_tokens(self.sampler(sampled_from, step.sampling, thresholds).tolist(), step)
        output = ModelRunnerOutput(tokens)
        if len(step.logprob_rows) or len(step.prompt_logprob_k):
            output.logprobs, output.prompt_logprobs = step_logprobs(step, logits, sampled_from, thresholds, tokens,
                                                                    self.logprobs_mode)
        return output
