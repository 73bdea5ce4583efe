"""The numpy sampler: the reference of the compiled op `fastdeploy.ops.sample` (and its fallback).

Order (vLLM V1 / FastDeploy): banned ids -> repetition, frequency, presence penalties on the raw
logits -> greedy rows take the argmax -> temperature -> top_k -> top_p -> min_p -> renormalise ->
draw. A sampled row inverts the CDF of its filtered distribution at its own uniform, drawn by the
caller from the row's generator, so a seeded request gives the same tokens whatever else is in the
batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastdeploy.ops.logits_filters import (
    Scratch,
    filter_thresholds,
    frequency_presence_penalty_,
    repetition_penalty_,
    token_pairs,
)

GREEDY_TEMPERATURE = 1e-5  # below this temperature a row is greedy (vLLM's epsilon)
_DRAW_BLOCK = 1024  # the draw inverts a per-block CDF, then the CDF inside one block
_CHUNK_ROWS = 8  # rows per pass: bounds work arrays (B=256 x 150k vocab) and stays cache-friendlier
_PARAM_CHECKS = (
    ("temperature", lambda a: np.isfinite(a) & (a >= 0), ">= 0"),
    ("top_p", lambda a: (a >= 0) & (a <= 1), "in [0, 1]"),
    ("top_k", lambda a: a >= -1, "-1, 0 (off) or >= 1"),
    ("min_p", lambda a: (a >= 0) & (a <= 1), "in [0, 1]"),
    ("repetition_penalty", lambda a: np.isfinite(a) & (a > 0), "> 0"),
    ("frequency_penalty", np.isfinite, "finite"),
    ("presence_penalty", np.isfinite, "finite"),
)


def greedy_rows(temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Which rows take the argmax instead of drawing."""
    return (temperature < GREEDY_TEMPERATURE) | (top_p <= 0) | (top_k == 1)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling inputs of one step. Trusted as they are: SamplingParams validated the values
    when the request was made (`from_lists` validates its own)."""

    temperature: np.ndarray  # float32 [B]; 0 => greedy
    top_p: np.ndarray  # float32 [B]; 1 => off; 0 => greedy
    top_k: np.ndarray  # int64 [B]; 0 or -1 => off; 1 => greedy
    min_p: np.ndarray  # float32 [B]; 0 => off
    repetition_penalty: np.ndarray  # float32 [B]; 1 => off; over prompt and output tokens
    frequency_penalty: np.ndarray  # float32 [B]; over output tokens
    presence_penalty: np.ndarray  # float32 [B]; over output tokens
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    banned_token_ids: list[Sequence[int]]  # set to -inf this step (EOS/stop ids below min_tokens)
    uniforms: np.ndarray  # float64 [B] in [0, 1): where each sampled row inverts its CDF (greedy: unread)
    # What greedy_mask(), plain_greedy() and untouched_logits() answer, when the caller already knows (the
    # scheduler does as it builds the rows); None: computed from the arrays.
    greedy: np.ndarray | None = None
    plain: bool | None = None
    untouched: bool | None = None

    def __len__(self) -> int:
        return len(self.temperature)

    def greedy_mask(self) -> np.ndarray:
        return greedy_rows(self.temperature, self.top_p, self.top_k) if self.greedy is None else self.greedy

    def plain_greedy(self) -> bool:
        """Every row is greedy on logits nothing changes: the tokens are a bare argmax."""
        if self.plain is not None:
            return self.plain
        return bool(self.greedy_mask().all()) and self.untouched_logits()

    def untouched_logits(self) -> bool:
        """No row bans a token or applies a penalty (each penalty is off or has no tokens to act on)."""
        if self.untouched is not None:
            return self.untouched
        if any(len(ids) for ids in self.banned_token_ids):
            return False
        outputs = np.array([len(ids) > 0 for ids in self.output_token_ids], dtype=bool)
        context = outputs | np.array([len(ids) > 0 for ids in self.prompt_token_ids], dtype=bool)
        return not (((self.repetition_penalty != 1) & context).any()
                    or (((self.frequency_penalty != 0) | (self.presence_penalty != 0)) & outputs).any())

    @classmethod
    def from_lists(
        cls,
        batch_size: int,
        *,
        temperature: float | Sequence[float] = 1.0,
        top_p: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        min_p: float | Sequence[float] = 0.0,
        repetition_penalty: float | Sequence[float] = 1.0,
        frequency_penalty: float | Sequence[float] = 0.0,
        presence_penalty: float | Sequence[float] = 0.0,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
        seeds: Sequence[int | None] | None = None,
        generators: Sequence[np.random.Generator | None] | None = None,
        uniforms: Sequence[float] | None = None,
    ) -> SamplingBatch:
        """A validated batch from scalars (shared by all rows) or per-row lists.

        Each sampled row draws its uniform now from its generator: `generators`, or
        `np.random.default_rng(seed)` per `seeds` (a None seed: fresh OS entropy); greedy rows draw
        nothing and may have a None generator. Or `uniforms` gives them.
        """

        def arr(value: object, dtype: type, name: str) -> np.ndarray:
            a = np.asarray(value, dtype=dtype)
            a = np.full(batch_size, a, dtype=dtype) if a.ndim == 0 else a
            if a.shape != (batch_size,):
                raise ValueError(f"{name} must be a scalar or a list of {batch_size} values")
            return a

        def seqs(value: Sequence[Sequence[int]] | None, name: str) -> list[Sequence[int]]:
            out = [[] for _ in range(batch_size)] if value is None else list(value)
            if len(out) != batch_size:
                raise ValueError(f"{name} must have {batch_size} rows, got {len(out)}")
            return out

        columns = dict(temperature=arr(temperature, np.float32, "temperature"), top_p=arr(top_p, np.float32, "top_p"),
                       top_k=arr(top_k, np.int64, "top_k"), min_p=arr(min_p, np.float32, "min_p"),
                       repetition_penalty=arr(repetition_penalty, np.float32, "repetition_penalty"),
                       frequency_penalty=arr(frequency_penalty, np.float32, "frequency_penalty"),
                       presence_penalty=arr(presence_penalty, np.float32, "presence_penalty"))
        for name, ok, allowed in _PARAM_CHECKS:
            good = ok(columns[name])
            if not good.all():
                row = int(np.argmin(good))
                raise ValueError(f"{name} of row {row} is {columns[name][row]}; allowed: {allowed}")
        if uniforms is not None:
            u = arr(uniforms, np.float64, "uniforms")
            if not ((u >= 0) & (u < 1)).all():
                raise ValueError("uniforms must be in [0, 1)")
        else:
            u = _draw_uniforms(columns, batch_size, seeds, generators)
        return cls(**columns, prompt_token_ids=seqs(prompt_token_ids, "prompt_token_ids"),
                   output_token_ids=seqs(output_token_ids, "output_token_ids"),
                   banned_token_ids=seqs(banned_token_ids, "banned_token_ids"), uniforms=u)


def _draw_uniforms(columns: dict[str, np.ndarray], batch_size: int, seeds: Sequence[int | None] | None,
                   generators: Sequence[np.random.Generator | None] | None) -> np.ndarray:
    """One uniform per sampled row from its own generator, in row order; 0 for greedy rows."""
    if generators is None:
        seed_list = [None] * batch_size if seeds is None else list(seeds)
        if len(seed_list) != batch_size:
            raise ValueError(f"seeds must have {batch_size} values, got {len(seed_list)}")
        generators = [np.random.default_rng(s) for s in seed_list]
    if len(generators) != batch_size:
        raise ValueError(f"generators must have {batch_size} rows, got {len(generators)}")
    sampled = np.flatnonzero(~greedy_rows(columns["temperature"], columns["top_p"], columns["top_k"]))
    missing = [int(i) for i in sampled if generators[i] is None]
    if missing:
        raise ValueError(f"generators of sampled rows {missing} are None; only greedy rows may omit one")
    uniforms = np.zeros(batch_size, dtype=np.float64)
    uniforms[sampled] = [generators[i].random() for i in sampled]
    return uniforms


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
    fastdeploy.ops.sample.
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


