"""Rotary position embedding, computed per step from the token positions (see fastdeploy.ops.rotary).

Two pairings exist: ERNIE-4.5 rotates adjacent pairs (x[2i], x[2i+1]) ("interleaved", GLM style in
transformers' modeling_ernie4_5), Llama/Qwen rotate (x[i], x[i + D/2]) ("neox" halves). Both use
frequency i for pair i. cos/sin are computed from float32 positions like transformers, once per step
for all layers, so no table bounded by max_position_embeddings is kept.
"""
from __future__ import annotations

import paddle

from fastdeploy import ops

CosSin = tuple[paddle.Tensor, paddle.Tensor]


class RotaryEmbedding:
    def __init__(self, head_dim: int, base: float, interleaved: bool) -> None:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        self.interleaved = interleaved

    def cos_sin(self, positions: paddle.Tensor) -> CosSin:
        """positions [T] -> cos, sin [T, D/2]."""
        return ops.rotary_cos_sin(positions, self.head_dim, self.base)

    def apply_(self, q: paddle.Tensor, k: paddle.Tensor, cos_sin: CosSin) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Rotates q [T, H, D] and k [T, KVH, D] in place (made contiguous first if needed)."""
        q = q if q.is_contiguous() else q.contiguous()
        k = k if k.is_contiguous() else k.contiguous()
        return ops.apply_rotary_(q, k, *cos_sin, self.interleaved)
