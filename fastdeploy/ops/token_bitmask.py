"""Grammar constraints on a step's logits: each constrained row's disallowed tokens set to -inf in place,
just before the sampling op, so the sampler (and the logprobs, as in vLLM) see only what the grammar
allows. Unconstrained rows are not touched and the logits matrix is not copied."""
from __future__ import annotations

import numpy as np
import paddle


def logits_view(logits: paddle.Tensor | np.ndarray) -> np.ndarray:
    """A writable numpy view of CPU float32 logits [B, V] (no copy)."""
    if isinstance(logits, np.ndarray):
        return logits
    if not isinstance(logits, paddle.Tensor) or logits.dtype != paddle.float32 or not logits.place.is_cpu_place():
        raise TypeError("logits must be float32 CPU logits (a paddle.Tensor or numpy array)")
    return np.from_dlpack(logits)


def apply_token_bitmask_(logits: paddle.Tensor | np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """For each i, set logits[rows[i], t] = -inf for every token t whose bit (bit t % 32 of word t // 32 of
    bitmask[i], int32) is 0. Tokens past the mask's width are disallowed too."""
    view = logits_view(logits)
    vocab = view.shape[1]
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or len(bitmask) != len(rows):
        raise ValueError(f"bitmask must be int32 [{len(rows)}, words], got {bitmask.dtype} {bitmask.shape}")
    width = min(vocab, bitmask.shape[1] * 32)
    # Little-endian int32 words, read as bytes with the low bit first, give the tokens in order.
    allowed = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, count=width, bitorder="little")
    for i, row in enumerate(rows.tolist()):
        target = view[row]
        np.putmask(target[:width], allowed[i] == 0, -np.inf)
        if width < vocab:
            target[width:] = -np.inf
