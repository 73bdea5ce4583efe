"""The tensor-parallel group a model is built for, and its collectives.

Layers read `current_tp()` while they are constructed (inside `building_for(tp)`) and keep that
group, so two models with different tensor-parallel sizes can live in one process. With one rank
every collective is the identity and the layers are exactly the single-process ones.

The group is a paddle.distributed process group made directly from a TCPStore (no
`init_parallel_env`, which is global, once per process and configured through environment
variables): this lets rank 0 live in the user's process and create a fresh group for every LLM.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import paddle

# "gloo" runs the collectives over TCP between CPU processes; on GPUs this would be "nccl".
BACKEND = "gloo"

# paddle keys its communicators by group id, for the life of the process: every LLM takes a new one,
# far from the small ids paddle.distributed.new_group gives out in case the user also uses it.
_group_ids = itertools.count(10_000)


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # paddle.distributed Group; None for a single rank
    store: Any = None  # the TCPStore the group was made with (kept alive as long as the group)

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """Sum of x over the ranks. Done as all-gather + local sum: on CPU gloo's all-gather is
        faster than its all-reduce for activation-sized tensors, and every rank adds the same
        numbers in the same order, so all ranks hold bitwise-identical results (MoE routing, which
        every rank computes on its own, relies on that)."""
        if self.size == 1:
            return x
        return self._gather(x).sum(axis=0)

    def all_gather(self, x: paddle.Tensor) -> paddle.Tensor:
        """Every rank's x concatenated along the last axis."""
        if self.size == 1:
            return x
        stacked = self._gather(x)  # [size, *x.shape]
        perm = list(range(1, x.ndim)) + [0, x.ndim]
        return stacked.transpose(perm).reshape(list(x.shape[:-1]) + [self.size * x.shape[-1]])

    def _gather(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x.contiguous()
        out = paddle.empty([self.size] + list(x.shape), dtype=x.dtype)
        paddle.distributed.stream.all_gather(out, x, group=self.group, sync_op=True)
        return out

    def check_divides(self, count: int, what: str) -> None:
        """ValueError naming tensor_parallel_size unless it divides `count`."""
        if count % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} must divide {what} ({count})")


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


def next_group_id() -> int:
    return next(_group_ids)


def create_store(rank: int, size: int, host: str, port: int, timeout_s: int = 900) -> Any:
    """The rendezvous store; rank 0 is the master and must create it before the others connect."""
    from paddle.base import core
    return core.TCPStore(host, port, rank == 0, size, timeout_s)


def create_group(rank: int, size: int, store: Any, group_id: int) -> TPGroup:
    """Join the process group `group_id` (blocks until all `size` ranks have joined)."""
    from paddle.distributed.collective import _new_process_group_impl
    from paddle.distributed.communication.group import Group

    name = f"fastdeploy_tp_{group_id}"
    # paddle's ProcessGroup constructor reads the global rank from this variable; set it for the
    # call only, so the user's process environment is left as it was.
    saved = os.environ.get("PADDLE_TRAINER_ID")  # env-ok
    os.environ["PADDLE_TRAINER_ID"] = str(rank)  # env-ok
    try:
        pg = _new_process_group_impl(BACKEND, store, rank, size, name, pg_options=None, group_id=group_id)
    finally:
        if saved is None:
            os.environ.pop("PADDLE_TRAINER_ID", None)  # env-ok
        else:
            os.environ["PADDLE_TRAINER_ID"] = saved  # env-ok
    group = Group(rank, group_id, list(range(size)), pg=pg, name=name)
    return TPGroup(rank, size, group, store)


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
    for name in ("moe_num_experts", "moe_intermediate_size"):
        if isinstance(raw.get(name), int) and not isinstance(raw.get(name), bool):
            counts.append((name, raw[name]))
    for name, count in counts:
        if count % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} must divide {name} ({count}) of this model")
    kv = config.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide num_key_value_heads ({kv}) or be a "
                         "multiple of it")
