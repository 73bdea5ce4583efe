"""The tensor-parallel group a model is built for, and its collectives.

Layers read `current_tp()` while they are constructed (inside `building_for(tp)`) and keep that
group, so two models with different tensor-parallel sizes can live in one process. With one rank
every collective is the identity and the layers are exactly the single-process ones. The ranks of one
host exchange tensors through shared memory (shm_comm.py), ranks on several hosts through a ring of TCP
connections (tcp_ring.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import paddle


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    comm: Any = None  # the ranks' ShmComm (one host) or RingComm (several); None for a single rank

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """Sum of x over the ranks, bitwise identical on every rank (MoE routing, computed by each rank on its
        own, relies on that)."""
        if self.size == 1:
            return x
        return self.comm.all_reduce(x)

    def gather_to_first(self, x: paddle.Tensor) -> paddle.Tensor:
        """Rank 0: every rank's x side by side along the last axis. What other ranks get is unspecified (the LM
        head's logits: only rank 0 samples, so across hosts only rank 0 receives them)."""
        if self.size == 1:
            return x
        return _along_last(self.comm.gather_to_first(x), x)

    def check_divides(self, count: int, what: str) -> None:
        """ValueError naming tensor_parallel_size unless it divides `count`."""
        if count % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} must divide {what} ({count})")


def _along_last(stacked: paddle.Tensor, x: paddle.Tensor) -> paddle.Tensor:
    """[size, *x.shape] -> the parts side by side along x's last axis."""
    perm = list(range(1, x.ndim)) + [0, x.ndim]
    return stacked.transpose(perm).reshape(list(x.shape[:-1]) + [stacked.shape[0] * x.shape[-1]])


SINGLE = TPGroup()
_building: TPGroup = SINGLE


def current_tp() -> TPGroup:
    """The group the model under construction is sharded over (SINGLE outside `building_for`)."""
    return _building


@contextmanager
def building_for(tp: TPGroup) -> Iterator[TPGroup]:
    global _building
    previous, _building = _building, tp
    try:
        yield tp
    finally:
        _building = previous


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank keeps: an equal share, or one replicated head when there are fewer KV
    heads than ranks."""
    return max(1, num_kv_heads // tp_size)


def kv_head_start(num_kv_heads: int, tp_size: int, rank: int) -> int:
    """The first KV head of `rank` (ranks r*R/KVH .. share head r*KVH // R when heads are replicated)."""
    return rank * num_kv_heads // tp_size


def check_tp_size(tp_size: int, config: Any) -> None:
    """ValueError naming tensor_parallel_size when the model (a ModelConfig) cannot be split that many
    ways: it must divide the attention heads, the KV heads (or be a multiple of them: heads are then
    replicated), the MLP widths and the number of experts."""
    if tp_size == 1:
        return
    raw = config.hf_config
    counts = [("num_attention_heads", config.num_attention_heads), ("intermediate_size", config.intermediate_size)]
    for name in ("moe_num_experts", "moe_intermediate_size", "num_experts", "num_local_experts"):
        if isinstance(raw.get(name), int) and not isinstance(raw.get(name), bool):
            counts.append((name, raw[name]))
    for name, count in counts:
        if count % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide {name} ({count}) of this model")
    kv = config.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide num_key_value_heads ({kv}) or be a "
                         "multiple of it")
