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

from fastdeploy.ops.kv_cache import allocate_cache
from fastdeploy.step_types import block_table_array


@dataclass(slots=True)
class ForwardContext:
    """How the step's T new tokens (ordered request by request) map onto the paged KV cache.

    A KV cache layer is one tensor [2, num_blocks, num_kv_heads, block_size, head_dim] (FastDeploy's
    block layout, keys then values); slot s = block * block_size + offset names the rows
    [:, block, :, offset]. Request b's new tokens are the last ones of its context.
    """

    slot_mapping: paddle.Tensor  # [T] int64: cache slot each new token's K/V is written to
    query_start_loc: paddle.Tensor  # [B+1] int64: request b's new tokens are rows [start[b], start[b+1])
    context_lens: paddle.Tensor  # [B] int64
    block_tables: paddle.Tensor  # [B, max_blocks] int64
    block_size: int
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
                       head_dim: int, dtype: str = "float32") -> list[paddle.Tensor]:
    """One [2, num_blocks, kv heads, block_size, row] cache per layer, `dtype` "float32", "bfloat16" or
    "block_wise_fp8" (fastdeploy/ops/kv_cache.py)."""
    return [allocate_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype) for _ in range(num_layers)]


def attention_metadata(query_lens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                       block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """query_lens[b] new tokens of request b are the last ones of its context_lens[b] tokens. Returns
    int64 arrays: slot_mapping [T], query_start_loc [B+1], context_lens [B], block_tables [B, max_blocks]."""
    q_lens = np.asarray(query_lens, dtype=np.int64)
    c_lens = np.asarray(context_lens, dtype=np.int64)
    tables = block_table_array(block_tables)
    # Context position of every new token, then its slot through the request's block table.
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    positions = np.arange(int(q_lens.sum())) - starts[rows] + (c_lens - q_lens)[rows]
    slot_mapping = (tables[rows, positions // block_size] * block_size + positions % block_size).astype(np.int64)
    return slot_mapping, starts, c_lens, tables


def build_forward_context(query_lens: Sequence[int], context_lens: Sequence[int],
                          block_tables: Sequence[Sequence[int]], block_size: int,
                          kv_caches: Sequence[paddle.Tensor]) -> ForwardContext:
    """The context of a step (see attention_metadata) as tensors, with the cache layers."""
    slot_mapping, starts, c_lens, tables = attention_metadata(query_lens, context_lens, block_tables, block_size)
    return ForwardContext(
        slot_mapping=paddle.to_tensor(slot_mapping),
        query_start_loc=paddle.to_tensor(starts),
        context_lens=paddle.to_tensor(c_lens),
        block_tables=paddle.to_tensor(tables),
        block_size=block_size,
        kv_caches=kv_caches,
    )
