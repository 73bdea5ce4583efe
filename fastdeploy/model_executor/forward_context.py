"""Per-step attention metadata, set once by the runner and read by every attention layer.

Like nano-vllm's context: the model's forward signature stays (input_ids, positions), and the
ragged-batch bookkeeping travels beside it instead of through every layer.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import paddle


@dataclass(slots=True)
class ForwardContext:
    """How the step's T new tokens (ordered request by request) map onto the paged KV cache.

    A KV cache layer is one tensor [2, num_blocks * block_size, num_kv_heads, head_dim]: slot
    s = block * block_size + offset. Attention is computed on a padded [B, max_query_len] view of
    the queries against a padded [B, max_context_len] gather of each request's cached keys.
    """

    slot_mapping: paddle.Tensor  # [T] int64: cache slot each new token's K/V is written to
    gather_slots: paddle.Tensor  # [B, Cmax] int64: slots of each request's context (pads read slot 0)
    query_index: paddle.Tensor  # [T] int64: position of each new token in the flat [B * Qmax] layout
    attn_bias: paddle.Tensor  # [B, 1, Qmax, Cmax] float32: 0 where a query may attend, -inf elsewhere
    num_reqs: int
    max_query_len: int
    max_context_len: int
    kv_caches: Sequence[paddle.Tensor]  # one per layer


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside of a forward context")
    return _current


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> list[paddle.Tensor]:
    shape = [2, num_blocks * block_size, num_kv_heads, head_dim]
    return [paddle.zeros(shape, dtype="float32") for _ in range(num_layers)]


def build_forward_context(query_lens: Sequence[int], context_lens: Sequence[int],
                          block_tables: Sequence[Sequence[int]], block_size: int,
                          kv_caches: Sequence[paddle.Tensor]) -> ForwardContext:
    """query_lens[b] new tokens of request b are the last ones of its context_lens[b] tokens."""
    q_lens = np.asarray(query_lens, dtype=np.int64)
    c_lens = np.asarray(context_lens, dtype=np.int64)
    num_reqs = len(q_lens)
    q_max, c_max = int(q_lens.max()), int(c_lens.max())

    # Slot of every context position of every request (padded with slot 0, masked below).
    ctx_pos = np.arange(c_max, dtype=np.int64)
    n_blocks = -(-c_max // block_size)
    tables = np.zeros((num_reqs, n_blocks), dtype=np.int64)
    for b, table in enumerate(block_tables):
        used = min(len(table), n_blocks)
        tables[b, :used] = table[:used]
    gather_slots = tables[:, ctx_pos // block_size] * block_size + ctx_pos % block_size
    valid_ctx = ctx_pos[None, :] < c_lens[:, None]
    gather_slots = np.where(valid_ctx, gather_slots, 0)

    # The new tokens of request b sit at context positions c_len - q_len + i.
    q_pos = np.arange(q_max, dtype=np.int64)
    valid_q = q_pos[None, :] < q_lens[:, None]
    start = (c_lens - q_lens)[:, None]
    new_ctx_pos = start + q_pos[None, :]
    slot_mapping = np.take_along_axis(gather_slots, np.minimum(new_ctx_pos, c_max - 1), axis=1)[valid_q]
    query_index = (np.arange(num_reqs, dtype=np.int64)[:, None] * q_max + q_pos[None, :])[valid_q]

    allowed = ctx_pos[None, None, :] <= new_ctx_pos[:, :, None]  # causal, which also bounds by c_len
    allowed |= ~valid_q[:, :, None]  # padded query rows see everything: no all-masked softmax rows
    bias = np.where(allowed, 0.0, -np.inf).astype(np.float32)[:, None, :, :]

    return ForwardContext(
        slot_mapping=paddle.to_tensor(slot_mapping),
        gather_slots=paddle.to_tensor(gather_slots),
        query_index=paddle.to_tensor(query_index),
        attn_bias=paddle.to_tensor(bias),
        num_reqs=num_reqs,
        max_query_len=q_max,
        max_context_len=c_max,
        kv_caches=kv_caches,
    )
