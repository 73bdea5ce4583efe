"""Mixture of experts: softmax top-k routing and the routed experts, in one compiled call per layer.

Routing (transformers' Ernie4_5_MoeTopKRouter semantics, computed in float32):
    probs = softmax(x @ W_gate)                                [T, E]
    ids = top_k(probs + e_score_correction_bias)               the bias only steers the choice
    weights = probs[ids] / max(sum(probs[ids]), norm_min)      renormalised over the chosen k
The experts' weights are stacked packed matrices (`FusedExperts`), so `ops.fused_moe` runs the router,
the chosen experts' gate/up, SiLU-and-mul and down projections, the weighted sum and the shared experts
without returning to Python (its reference, `ops.moe.grouped_expert_forward`, is today's grouped path).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import ops
from fastdeploy.distributed.parallel_state import TPGroup, current_tp
from fastdeploy.model_executor.layers.linear import GatedMLP, Linear, Parts, _check_shape
from fastdeploy.model_executor.layers.packed import PackedParameter, WeightSlot, add_slot


class MoEStatics(nn.Layer):
    """Holds `e_score_correction_bias` [rows, num_experts] (checkpoint name `mlp.moe_statics.*`): one row
    per router (ERNIE-4.5-VL: row 0 text, row 1 vision).

    A checkpoint may lack it (transformers then keeps zeros, i.e. plain top-k): it is marked optional."""

    def __init__(self, num_experts: int, rows: int = 1) -> None:
        super().__init__()
        self.num_experts, self.rows = num_experts, rows
        self.e_score_correction_bias = self.create_parameter(
            [rows, num_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0))
        self.e_score_correction_bias.stop_gradient = True
        self.e_score_correction_bias.weight_loader = self.weight_loader
        self.e_score_correction_bias.optional_in_checkpoint = True

    def weight_loader(self, param: paddle.Tensor, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"e_score_correction_bias has no shards (got shard {shard_id!r})")
        flat_ok = self.rows == 1 and list(array.shape) == [self.num_experts]
        if list(array.shape) != [self.rows, self.num_experts] and not flat_ok:
            also = f" (or [{self.num_experts}])" if self.rows == 1 else ""
            raise ValueError(f"e_score_correction_bias: got shape {list(array.shape)}, the model expects "
                             f"[{self.rows}, {self.num_experts}]{also}")
        param.set_value(np.asarray(array, dtype=np.float32).reshape([self.rows, self.num_experts]))

    def bias(self, row: int = 0) -> paddle.Tensor:
        """The correction bias [num_experts] of router `row`."""
        return self.e_score_correction_bias[row]


class FusedExperts(nn.Layer):
    """Experts [start, start + count) of `num_experts`, each a gated MLP, as two stacked packed weights:
    up_gate [count x (hidden, 2 * intermediate)] ([gate | up] columns) and down [count x (intermediate,
    hidden)]. Checkpoint tensors `experts.K.{up_gate_proj,gate_proj,up_proj,down_proj}.weight` (global
    expert id K) each fill expert K's slice."""

    def __init__(self, hidden_size: int, intermediate_size: int, start: int, count: int) -> None:
        super().__init__()
        self.start, self.count = start, count
        self.up_gate = PackedParameter(hidden_size, 2 * intermediate_size, experts=count)
        self.down = PackedParameter(intermediate_size, hidden_size, experts=count)
        self.parts = Parts([intermediate_size] * 2, ["gate", "up"], [(0, intermediate_size)] * 2)
        for local, expert in enumerate(range(start, start + count)):
            add_slot(self, f"{expert}.up_gate_proj.weight", WeightSlot(
                self.up_gate, [hidden_size, 2 * intermediate_size], self.up_gate_loader,
                part_sizes=self.parts.named_sizes, expert=local))
            add_slot(self, f"{expert}.down_proj.weight", WeightSlot(
                self.down, [intermediate_size, hidden_size], self.down_loader, expert=local))

    def up_gate_loader(self, slot: WeightSlot, array: Any, shard_id: int | str | None = None) -> None:
        self.parts.load(lambda part, col: self.up_gate.fill(part, col, slot.expert), slot.global_shape, array,
                        shard_id)

    def down_loader(self, slot: WeightSlot, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"down_proj has no parts (got shard {shard_id!r})")
        _check_shape(slot, array, "weight")
        self.down.fill(array, 0, slot.expert)


class SparseMoE(nn.Layer):
    """Routed experts with a linear softmax gate, plus (optionally) always-on shared experts. Parameters:
    `gate.weight` [hidden, E], `moe_statics.e_score_correction_bias` [1, E] (absent without
    `correction_bias`: plain top-k, as Qwen3-MoE), `experts.K.*`.

    Tensor parallel: the router is replicated (every rank routes every token identically, from
    bitwise-identical inputs) and rank r keeps experts [r * E / R, (r + 1) * E / R), whole; the shared
    experts are column/row-parallel like a dense MLP. Each rank computes its share and `forward` sums
    the shares over the ranks with one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_min: float | None = None, hidden_act: str = "silu", shared_intermediate_size: int = 0,
                 shared_bias: bool = False, tp: TPGroup | None = None, correction_bias: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        self.tp = tp if tp is not None else current_tp()
        self.tp.check_divides(num_experts, "the number of experts")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_min = norm_min
        self.gate = Linear(hidden_size, num_experts, bias=False, role="router")
        self.moe_statics = MoEStatics(num_experts) if correction_bias else None
        per = num_experts // self.tp.size
        self.experts = FusedExperts(hidden_size, intermediate_size, self.tp.rank * per, per)
        # Checkpoint tensors of other ranks' experts are not read here (see load.py).
        self.other_rank_children = [f"experts.{e}" for e in range(num_experts)
                                    if not self.experts.start <= e < self.experts.start + per]
        self.shared_experts = None
        if shared_intermediate_size:
            self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, bias=shared_bias,
                                           hidden_act=hidden_act, tp=self.tp)

    def partial(self, x: paddle.Tensor) -> paddle.Tensor:
        """This rank's share of the output: its routed experts and its slice of the shared experts."""
        shared = self.shared_experts
        fused_shared = shared is not None and shared.up_gate_proj.bias is None and shared.down_proj.bias is None
        out = ops.fused_moe(
            x, self.gate.packed, self.moe_statics.bias() if self.moe_statics is not None else None,
            self.experts.up_gate.value, self.experts.down.value,
            self.top_k, self.norm_min, self.experts.start, self.num_experts,
            shared.up_gate_proj.packed if fused_shared else None, shared.down_proj.packed if fused_shared else None)
        if shared is not None and not fused_shared:
            out = out + shared(x, reduce=False)
        return out

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.tp.all_reduce(self.partial(x))
