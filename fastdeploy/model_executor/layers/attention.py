"""Paged attention over a ragged batch (the compiled op, or its pure-Paddle reference).

Each call first writes the step's new K/V into the layer's cache slots, then every query attends
causally to its request's cached context. Decode tokens and prefill chunks take the same path.
"""
from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy import ops

from fastdeploy.model_executor.forward_context import get_forward_context


class Attention(nn.Layer):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D]."""
        ctx = get_forward_context()
        return ops.paged_attention(q, k, v, ctx.kv_caches[self.layer_idx], ctx.slot_mapping, ctx.query_start_loc,
                                   ctx.context_lens, ctx.block_tables, ctx.block_size, self.scale)
