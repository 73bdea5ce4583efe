"""Paged attention over a ragged batch (pure Paddle).

Each call first writes the step's new K/V into the layer's cache slots, then every query attends
to its request's whole cached context. Decode tokens and prefill chunks go through the same path.
"""
from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

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
        cache = ctx.kv_caches[self.layer_idx]
        cache[0].scatter_(ctx.slot_mapping, k, overwrite=True)
        cache[1].scatter_(ctx.slot_mapping, v, overwrite=True)

        b, qm, cm = ctx.num_reqs, ctx.max_query_len, ctx.max_context_len
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        slots = ctx.gather_slots.reshape([-1])
        keys = paddle.gather(cache[0], slots).reshape([b, cm, kvh, d]).transpose([0, 2, 1, 3])
        values = paddle.gather(cache[1], slots).reshape([b, cm, kvh, d]).transpose([0, 2, 1, 3])

        # Grouped queries: the heads sharing a KV head are stacked along the query axis.
        padded = paddle.zeros([b * qm, h, d], dtype=q.dtype)
        padded = paddle.scatter(padded, ctx.query_index, q, overwrite=True)
        queries = padded.reshape([b, qm, kvh, h // kvh, d]).transpose([0, 2, 3, 1, 4])
        queries = queries.reshape([b, kvh, (h // kvh) * qm, d])

        scores = paddle.matmul(queries, keys, transpose_y=True) * self.scale
        scores = scores.reshape([b, kvh, h // kvh, qm, cm]) + ctx.attn_bias.unsqueeze(1)
        probs = F.softmax(scores, axis=-1).reshape([b, kvh, (h // kvh) * qm, cm])
        out = paddle.matmul(probs, values)  # [b, kvh, g*qm, d]
        out = out.reshape([b, kvh, h // kvh, qm, d]).transpose([0, 3, 1, 2, 4]).reshape([b * qm, h * d])
        return paddle.gather(out, ctx.query_index)
