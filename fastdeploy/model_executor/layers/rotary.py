"""Rotary position embedding, computed per step from the token positions.

Two pairings exist: ERNIE-4.5 rotates adjacent pairs (x[2i], x[2i+1]) ("interleaved", GLM style in
transformers' modeling_ernie4_5), Llama/Qwen rotate (x[i], x[i + D/2]) ("neox" halves). Both use
frequency i for pair i. cos/sin are computed from float32 positions like transformers, so no
table bounded by max_position_embeddings is kept.
"""
from __future__ import annotations

import numpy as np
import paddle


class RotaryEmbedding:
    def __init__(self, head_dim: int, base: float, interleaved: bool) -> None:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        self.interleaved = interleaved
        # float32 exponent and power, as transformers computes inv_freq.
        exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        inv_freq = (np.float32(1.0) / np.power(np.float32(base), exponent)).astype(np.float32)
        self.inv_freq = paddle.to_tensor(inv_freq)

    def cos_sin(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """positions [T] -> cos, sin [T, 1, D/2] (broadcast over heads)."""
        freqs = positions.astype("float32").unsqueeze(-1) * self.inv_freq
        return paddle.cos(freqs).unsqueeze(1), paddle.sin(freqs).unsqueeze(1)

    def apply(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        """x [T, H, D] -> rotated [T, H, D]."""
        t, h, d = x.shape
        if self.interleaved:
            pairs = x.reshape([t, h, d // 2, 2])
            x1, x2 = pairs[..., 0], pairs[..., 1]
            return paddle.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape([t, h, d])
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def __call__(self, positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor
                 ) -> tuple[paddle.Tensor, paddle.Tensor]:
        cos, sin = self.cos_sin(positions)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)
