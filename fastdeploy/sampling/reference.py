"""The numpy sampler: the reference of the compiled op `fastdeploy.sampling.sampler.sample` (and its fallback).

Order (vLLM V1 / FastDeploy): banned ids -> repetition, frequency, presence penalties on the raw
logits -> greedy rows take the argmax -> temperature -> top_k -> top_p -> min_p -> renormalise ->
draw. A sampled row inverts the CDF of its filtered distribution at its own uniform, drawn by the
caller from the row's generator, so a seeded request gives the same tokens whatever else is in the
batch.
"""
from __future__ import annotations

import numpy as np

from fastdeploy.sampling.filters import (
    Scratch,
    filter_thresholds,
    frequency_presence_penalty_,
    repetition_penalty_,
    token_pairs,
)
from fastdeploy.step_types import SamplingBatch

_DRAW_BLOCK = 1024  # the draw inverts a per-block CDF, then the CDF inside one block
_CHUNK_ROWS = 8  # rows per pass: bounds work arrays (B=256 x 150k vocab) and stays cache-friendlier


def draw(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw of one token per row of non-negative weights `probs` [S, V].

    Tokens of weight 0 are never drawn. Work per row is O(V / block + block) after one
    vectorised pass that sums the blocks.
    """
    n_rows, vocab = probs.shape
    starts = np.arange(0, vocab, _DRAW_BLOCK)
    block_mass = np.add.reduceat(probs, starts, axis=1, dtype=np.float64)
    cum = np.cumsum(block_mass, axis=1)
    target = uniforms * cum[:, -1]
    blocks = (cum <= target[:, None]).sum(axis=1)
    # rounding could push the target to the very end: fall back to the last block with mass
    last = block_mass.shape[1] - 1 - np.argmax(block_mass[:, ::-1] > 0, axis=1)
    blocks = np.minimum(blocks, last)
    ridx = np.arange(n_rows)
    rest = target - np.where(blocks > 0, cum[ridx, blocks - 1], 0.0)
    out = np.empty(n_rows, dtype=np.int64)
    for i in range(n_rows):
        lo = int(starts[blocks[i]])
        seg = probs[i, lo:lo + _DRAW_BLOCK]
        j = int(np.searchsorted(np.cumsum(seg, dtype=np.float64), rest[i], side="right"))
        if j >= seg.size:
            j = int(np.flatnonzero(seg)[-1])
        out[i] = lo + j
    return out


def _ban_and_penalise(x: np.ndarray, batch: SamplingBatch, rows: np.ndarray) -> None:
    """In place on x, the logits of batch rows `rows`: banned ids to -inf, then the penalties."""
    vocab = x.shape[1]
    if any(len(batch.banned_token_ids[r]) for r in rows):
        i, t = token_pairs(batch.banned_token_ids, rows, vocab, "banned_token_ids")
        x[i, t] = -np.inf
    rep = batch.repetition_penalty[rows]
    sub = np.flatnonzero(rep != 1)
    if sub.size:  # over the prompt and the output tokens
        i1, t1 = token_pairs(batch.prompt_token_ids, rows[sub], vocab, "prompt_token_ids")
        i2, t2 = token_pairs(batch.output_token_ids, rows[sub], vocab, "output_token_ids")
        repetition_penalty_(x, sub[np.concatenate([i1, i2])], np.concatenate([t1, t2]), rep)
    fp, pp = batch.frequency_penalty[rows], batch.presence_penalty[rows]
    sub = np.flatnonzero((fp != 0) | (pp != 0))
    if sub.size:  # over the output tokens only
        i, t = token_pairs(batch.output_token_ids, rows[sub], vocab, "output_token_ids")
        frequency_presence_penalty_(x, sub[i], t, fp, pp)


def processed_logits(view: np.ndarray, batch: SamplingBatch, rows: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """The logits batch rows `rows` were sampled from (float32 [len(rows), V]; `view` is not written): bans
    at -inf and penalties, then for sampled rows divided by the temperature, the tokens below the row's
    filter threshold (the sampler's `thresholds`, per batch row) at -inf. Greedy rows stop after the
    penalties (vLLM's processed logits)."""
    x = view[rows]  # a copy
    _ban_and_penalise(x, batch, rows)
    sampled = np.flatnonzero(~batch.greedy_mask()[rows])
    if sampled.size:
        scaled = x[sampled] / batch.temperature[rows[sampled]][:, None]
        tau = thresholds[rows[sampled]]
        x[sampled] = np.where(scaled >= tau[:, None], scaled, -np.inf)
    return x


def sample_numpy(view: np.ndarray, batch: SamplingBatch, greedy: np.ndarray, uniforms: np.ndarray,
                 scratch: Scratch | None = None, thresholds: np.ndarray | None = None) -> np.ndarray:
    """The numpy sampler: one token per row of the float32 [B, V] logits `view` (never written).

    `greedy` [B] marks the rows that take the argmax; each other row inverts its filtered CDF at its
    uniform (float64 [B], read only for those rows). `thresholds` (float32 [B]), if given, receives
    each sampled row's filter threshold (it kept logit / temperature >= it). Also the reference of
    fastdeploy.sampling.sampler.sample.
    """
    scratch = Scratch() if scratch is None else scratch
    n_rows, vocab = view.shape
    changed = (
        np.fromiter(map(len, batch.banned_token_ids), dtype=np.int64, count=n_rows) > 0
    ) | (batch.repetition_penalty != 1) | (batch.frequency_penalty != 0) | (batch.presence_penalty != 0)
    plain = greedy & ~changed
    if plain.all():
        return view.argmax(axis=1).astype(np.int64)
    out = np.empty(n_rows, dtype=np.int64)
    # Rows are copied into a reused work array a chunk at a time: this bounds memory
    # (B = 256 rows of a 150k vocabulary) and avoids fresh, page-faulting arrays each step.
    for group, sampled in ((plain, False), (greedy & changed, False), (~greedy, True)):
        idx = np.flatnonzero(group)
        for lo in range(0, idx.size, _CHUNK_ROWS):
            rows = idx[lo:lo + _CHUNK_ROWS]
            x = np.take(view, rows, axis=0, out=scratch.get("rows", (rows.size, vocab), np.float32))
            _ban_and_penalise(x, batch, rows)
            if not sampled:
                out[rows] = x.argmax(axis=1)
                continue
            out[rows], tau = _sample_rows(x, batch, rows, uniforms[rows], scratch)
            if thresholds is not None:
                thresholds[rows] = tau
    return out


def _sample_rows(x: np.ndarray, batch: SamplingBatch, rows: np.ndarray, uniforms: np.ndarray,
                 scratch: Scratch) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and filter thresholds of the sampled batch rows `rows`; x [len(rows), V] is a work
    copy, overwritten."""
    x /= batch.temperature[rows][:, None]
    m = x.max(axis=1)
    bad = np.flatnonzero(~np.isfinite(m))
    if bad.size:
        raise ValueError(f"logits of row {int(rows[bad[0]])} are all -inf or hold NaN/inf")
    e = scratch.get("exp", x.shape, np.float32)
    np.subtract(x, m[:, None], out=e)
    np.exp(e, out=e)
    tau = filter_thresholds(x, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows],
                            row_max=m, exp_logits=e, scratch=scratch)
    if (tau > -np.inf).any():
        np.multiply(e, x >= tau[:, None], out=e)  # several times faster than copyto(where=)
    return draw(e, uniforms), tau


