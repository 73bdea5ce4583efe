"""Pure penalty and filtering steps of the sampler, over float32 [B, V] logit arrays.

The penalties work in place (`*_`); filters give per-row thresholds.

Filters are expressed as one logit threshold per row (keep tokens with logit >= tau), so that
top-k, top-p and min-p combine into a single mask and ties at a cut are kept (as transformers'
top-k keeps them). Finding the cut of top-k or top-p must not sort ~100k tokens per row: a
histogram of exp(logit - row max) in bins of 1/8 octave gives, per row, the bin that holds the
k-th token or where the probability mass reaches top_p; only the tokens of that bin (or, for
top-k, of the bins above it too) are sorted.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_KEY_SHIFT = 20  # float32 bits >> 20 keep the exponent and 3 mantissa bits
_NUM_BINS = 1024  # every float32 in [0, 1] has a key below 1024


def _as_2d(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"logits must be a 2-D [batch, vocab] array, got shape {x.shape}")
    return x


def _per_row(value: float | Sequence[float] | np.ndarray, batch: int, dtype: type, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype=dtype)
    if arr.ndim == 0:
        return np.full(batch, arr, dtype=dtype)
    if arr.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have one value per row ({batch}), got shape {arr.shape}")
    return arr


def token_pairs(seqs: Sequence[Sequence[int]], rows: np.ndarray, vocab_size: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(position in `rows`, token) int64 pairs of those rows' sequences, checked against the vocabulary."""
    picked = [seqs[r] for r in rows]
    lens = np.fromiter(map(len, picked), dtype=np.int64, count=len(picked))
    toks = np.fromiter(itertools.chain.from_iterable(picked), dtype=np.int64, count=int(lens.sum()))
    if toks.size and (toks.min() < 0 or toks.max() >= vocab_size):
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size})")
    return np.repeat(np.arange(len(picked), dtype=np.int64), lens), toks


# ----------------------------------------------------------------------------- penalties


def repetition_penalty_(x: np.ndarray, rows: np.ndarray, toks: np.ndarray, penalty: np.ndarray) -> None:
    """In place: each (row, token) seen at least once -> logit / p if positive, logit * p if not."""
    if rows.size == 0:
        return
    vocab = x.shape[1]
    r, t = np.divmod(np.unique(rows * vocab + toks), vocab)
    vals = x[r, t]
    p = penalty[r].astype(np.float32)
    x[r, t] = np.where(vals > 0, vals / p, vals * p)


def frequency_presence_penalty_(
    x: np.ndarray, rows: np.ndarray, toks: np.ndarray, frequency: np.ndarray, presence: np.ndarray
) -> None:
    """In place, OpenAI's formula: logit -= count * frequency + (count > 0) * presence."""
    if rows.size == 0:
        return
    vocab = x.shape[1]
    keys, counts = np.unique(rows * vocab + toks, return_counts=True)
    r, t = np.divmod(keys, vocab)
    x[r, t] -= (counts * frequency[r].astype(np.float64) + presence[r]).astype(np.float32)


# ----------------------------------------------------------------------------- filters


class Scratch:
    """Work arrays kept between calls: a fresh multi-MB array costs page faults on every step."""

    __slots__ = ("_bufs",)

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        size = int(np.prod(shape))
        buf = self._bufs.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._bufs[name] = np.empty(size, dtype=dtype)
        return buf[:size].reshape(shape)


@dataclass(slots=True)
class _Groups:
    """Selected tokens of each row, sorted by descending logit, as one ragged array."""

    rows: np.ndarray  # row of each element
    x: np.ndarray  # logits
    e: np.ndarray  # exp(logit - row max), float64
    starts: np.ndarray  # [R] index of each row's first element
    sizes: np.ndarray  # [R]

    @classmethod
    def select(cls, x: np.ndarray, e: np.ndarray, mask: np.ndarray) -> _Groups:
        idx = np.flatnonzero(mask)
        rows = idx // x.shape[1]
        xv = x.ravel()[idx]
        order = np.lexsort((-xv, rows))  # stable: ties stay in token order
        rows = rows[order]
        sizes = np.bincount(rows, minlength=x.shape[0])
        starts = np.cumsum(sizes) - sizes
        return cls(rows, xv[order], e.ravel()[idx[order]].astype(np.float64), starts, sizes)

    def at(self, pos: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return self.x[self.starts[rows] + pos[rows]]

    def cumsum(self) -> np.ndarray:
        """Running mass inside each row's group."""
        c = np.cumsum(self.e)
        first = self.starts[self.rows]
        return c - (c[first] - self.e[first])


def _first_reached_pos(g: _Groups, reached: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Per row, the position of the first reached element, at most limit - 1."""
    before = np.bincount(g.rows[~reached], minlength=g.sizes.size)
    return np.minimum(before, limit - 1)


def _top_down(hist: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the first non-empty bin, from the highest down, where the running sum reaches
    target (the lowest non-empty bin if rounding keeps it short), and the sum of the bins above it."""
    cum = np.cumsum(hist[:, ::-1], axis=1)
    j = np.argmax((cum >= np.minimum(target, cum[:, -1])[:, None]) & (cum > 0), axis=1)
    bins = _NUM_BINS - 1 - j
    ridx = np.arange(hist.shape[0])
    return bins, cum[ridx, j] - hist[ridx, bins]


def _cut_thresholds(
    x: np.ndarray, e: np.ndarray, k: np.ndarray, p: np.ndarray, keep_n: int, scratch: Scratch
) -> tuple[np.ndarray, np.ndarray]:
    """Thresholds of top-k then top-p (renormalised after top-k), and the keep_n-th largest logit."""
    n_rows, vocab = x.shape
    # For non-negative float32, the bit pattern grows with the value: its top bits are a
    # histogram bin (8 per octave of probability) that orders tokens like their logits do.
    bins = scratch.get("bins", x.shape, np.int32)
    np.right_shift(e.view(np.int32), _KEY_SHIFT, out=bins)
    keys = scratch.get("keys", x.shape, np.int64)  # bincount wants int64: convert once, here
    np.copyto(keys, bins)
    keys += (np.arange(n_rows, dtype=np.int64) * _NUM_BINS)[:, None]
    k_on = (k > 0) & (k < vocab)
    p_on = p < 1.0
    need_n = np.where(k_on, k, 0)
    if keep_n > 1:
        need_n = np.maximum(need_n, keep_n)
    by_count = need_n > 0  # the kept set is a top-n prefix: sort all tokens down to its bin
    by_mass = p_on & ~by_count  # only the bin where the mass reaches top_p needs sorting
    tau = np.full(n_rows, -np.inf, dtype=np.float32)
    tau_keep = np.full(n_rows, np.inf, dtype=np.float32)

    total = b_mass = None
    if (p_on & ~k_on).any():
        w = scratch.get("weights", x.shape, np.float64)
        np.copyto(w, e)  # bincount would convert to float64 in a fresh array
        mass = np.bincount(keys.ravel(), weights=w.ravel(), minlength=n_rows * _NUM_BINS)
        mass = mass.reshape(n_rows, _NUM_BINS)
        total = mass.sum(axis=1)
        b_mass, mass_above = _top_down(mass, p * total)

    if by_count.any():
        counts = np.bincount(keys.ravel(), minlength=n_rows * _NUM_BINS).reshape(n_rows, _NUM_BINS)
        b = _top_down(counts, need_n)[0]
        if b_mass is not None:
            b = np.where(p_on & ~k_on, np.minimum(b, b_mass), b)
        g = _Groups.select(x, e, bins >= np.where(by_count, b, _NUM_BINS).astype(np.int32)[:, None])
        rows = np.flatnonzero(by_count)
        in_k = np.ones(g.x.size, dtype=bool)
        kr = np.flatnonzero(k_on)
        if kr.size:
            tau[kr] = g.at(k - 1, kr)
            in_k = g.x >= tau[g.rows]  # ties at the k-th logit are kept
        n_in = np.bincount(g.rows[in_k], minlength=n_rows)
        pr = np.flatnonzero(p_on & by_count)
        if pr.size:
            z = np.bincount(g.rows[in_k], weights=g.e[in_k], minlength=n_rows)
            if total is not None:
                z = np.where(k_on, z, total)
            reached = g.cumsum() >= (p * z)[g.rows]
            pos = _first_reached_pos(g, reached | ~in_k, n_in)
            tau[pr] = np.maximum(tau[pr], g.at(pos, pr))
        if keep_n > 1:
            tau_keep[rows] = g.at(np.full(n_rows, keep_n - 1), rows)

    if by_mass.any():
        g = _Groups.select(x, e, bins == np.where(by_mass, b_mass, -1).astype(np.int32)[:, None])
        mr = np.flatnonzero(by_mass)
        reached = mass_above[g.rows] + g.cumsum() >= (p * total)[g.rows]
        pos = _first_reached_pos(g, reached, g.sizes)
        tau[mr] = g.at(pos, mr)
    return tau, tau_keep


def filter_thresholds(
    logits: np.ndarray,
    top_k: int | Sequence[int] | np.ndarray = 0,
    top_p: float | Sequence[float] | np.ndarray = 1.0,
    min_p: float | Sequence[float] | np.ndarray = 0.0,
    min_tokens_to_keep: int = 1,
    *,
    row_max: np.ndarray | None = None,
    exp_logits: np.ndarray | None = None,
    scratch: Scratch | None = None,
) -> np.ndarray:
    """Per-row logit threshold of top_k -> top_p -> min_p: keep tokens with logit >= tau.

    top_k 0/-1 (or >= vocab) is off; top_p 1 is off; min_p 0 is off. `min_tokens_to_keep` is
    transformers' option (at least that many tokens survive). `row_max` (x.max(1)) and
    `exp_logits` (float32 exp(x - row_max)) may be passed when the caller already has them.
    """
    x = _as_2d(logits)
    n_rows, vocab = x.shape
    k = _per_row(top_k, n_rows, np.int64, "top_k")
    p = _per_row(top_p, n_rows, np.float64, "top_p")
    mp = _per_row(min_p, n_rows, np.float64, "min_p")
    if min_tokens_to_keep >= vocab:
        return np.full(n_rows, -np.inf, dtype=np.float32)
    m = x.max(axis=1) if row_max is None else row_max
    if not np.isfinite(m).all():
        raise ValueError("logits: every row needs a finite largest logit (no NaN/inf, not all -inf)")
    scratch = Scratch() if scratch is None else scratch
    tau = np.full(n_rows, -np.inf, dtype=np.float32)
    tau_keep = np.full(n_rows, np.inf, dtype=np.float32)
    cut = np.flatnonzero(((k > 0) & (k < vocab)) | (p < 1.0) | (min_tokens_to_keep > 1))
    if cut.size == n_rows:
        xs = x
        es = np.exp(x - m[:, None]) if exp_logits is None else exp_logits
    elif cut.size:
        xs = np.take(x, cut, axis=0, out=scratch.get("cut_x", (cut.size, vocab), np.float32))
        if exp_logits is None:
            es = np.exp(xs - m[cut, None])
        else:
            es = np.take(exp_logits, cut, axis=0, out=scratch.get("cut_e", (cut.size, vocab), np.float32))
    if cut.size:
        tau[cut], tau_keep[cut] = _cut_thresholds(xs, es, k[cut], p[cut], int(min_tokens_to_keep), scratch)
    on = mp > 0
    if on.any():
        # prob >= min_p * max prob  <=>  logit >= max logit + log(min_p)
        tau[on] = np.maximum(tau[on], (m[on] + np.log(mp[on])).astype(np.float32))
    return np.minimum(tau, tau_keep)
