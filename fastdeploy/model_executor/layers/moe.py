"""Mixture of experts: softmax top-k routing and expert computation grouped by expert.

Routing (transformers' Ernie4_5_MoeTopKRouter semantics, computed in float32):
    probs = softmax(x @ W_gate)                                [T, E]
    ids = top_k(probs + e_score_correction_bias)               the bias only steers the choice
    weights = probs[ids] / max(sum(probs[ids]), norm_min)      renormalised over the chosen k
Experts run grouped: the T*k (token, expert) assignments are sorted by expert, each expert that got
any runs one GEMM chain over its gathered rows, and the weighted results are scatter-added back, so
the cost is one small GEMM per active expert rather than a loop over tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.distributed.parallel_state import SINGLE, TPGroup, current_tp
from fastdeploy.model_executor.layers.linear import GatedMLP, Linear


class MoEStatics(nn.Layer):
    """Holds `e_score_correction_bias` [1, num_experts] (checkpoint name `mlp.moe_statics.*`).

    A checkpoint may lack it (transformers then keeps zeros, i.e. plain top-k): it is marked optional."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.e_score_correction_bias = self.create_parameter(
            [1, num_experts], dtype="float32", default_initializer=nn.initializer.Constant(0.0))
        self.e_score_correction_bias.stop_gradient = True
        self.e_score_correction_bias.weight_loader = self.weight_loader
        self.e_score_correction_bias.optional_in_checkpoint = True

    def weight_loader(self, param: paddle.Tensor, array: np.ndarray, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"e_score_correction_bias has no shards (got shard {shard_id!r})")
        if array.size != self.num_experts or array.ndim > 2:
            raise ValueError(f"e_score_correction_bias: got shape {list(array.shape)}, the model expects "
                             f"[1, {self.num_experts}] (or [{self.num_experts}])")
        param.set_value(np.asarray(array, dtype=np.float32).reshape([1, self.num_experts]))

    @property
    def bias(self) -> paddle.Tensor:
        return self.e_score_correction_bias.reshape([-1])


def select_experts(probs: paddle.Tensor, top_k: int, correction_bias: paddle.Tensor | None = None,
                   norm_min: float | None = None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """probs [T, E] -> (weights [T, k] float32, expert ids [T, k] int64).

    correction_bias [E] is added only for choosing; norm_min=None leaves the weights unnormalised."""
    choice = probs if correction_bias is None else probs + correction_bias
    _, ids = paddle.topk(choice, top_k, axis=-1)
    weights = paddle.take_along_axis(probs, ids, axis=-1)
    if norm_min is not None:
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=norm_min)
    return weights, ids


def grouped_expert_forward(x: paddle.Tensor, weights: paddle.Tensor, ids: paddle.Tensor,
                           experts: Sequence[nn.Layer | None]) -> paddle.Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every token t, grouped by expert.

    Experts given as None live on other tensor-parallel ranks: their share is left out here (the
    ranks' results are summed by the caller)."""
    top_k = ids.shape[-1]
    flat = ids.reshape([-1]).numpy()  # host copy: the grouping is bookkeeping, not math
    here = np.array([e is not None for e in experts])
    keep = np.flatnonzero(here[flat])  # the (token, choice) assignments this rank computes
    if keep.size == 0:
        return paddle.zeros_like(x)
    order = keep[np.argsort(flat[keep], kind="stable")]
    counts = np.bincount(flat[order], minlength=len(experts))
    tokens = paddle.to_tensor(order // top_k)
    gathered = paddle.gather(x, tokens)
    pieces, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            pieces.append(experts[expert](gathered[start:start + count]))
            start += count
    out = paddle.concat(pieces) if len(pieces) > 1 else pieces[0]
    out = out * paddle.gather(weights.reshape([-1]), paddle.to_tensor(order)).unsqueeze(-1)
    return paddle.index_add(paddle.zeros_like(x), tokens, 0, out)


class SparseMoE(nn.Layer):
    """Routed experts with a linear softmax gate. Parameters: `gate.weight` [hidden, E],
    `moe_statics.e_score_correction_bias` [1, E], `experts.K.{up_gate_proj,down_proj}.weight`.

    Tensor parallel: the router is replicated (every rank routes every token identically, from
    bitwise-identical inputs) and rank r keeps experts [r * E / R, (r + 1) * E / R), whole; each rank
    computes its experts' share and `forward` sums the shares over the ranks."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_min: float | None = None, hidden_act: str = "silu", tp: TPGroup | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.tp = tp if tp is not None else current_tp()
        self.tp.check_divides(num_experts, "the number of experts")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_min = norm_min
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.gate.quantizable = False  # routing decides which experts run: keep it exact
        self.moe_statics = MoEStatics(num_experts)
        per = num_experts // self.tp.size
        mine = range(self.tp.rank * per, (self.tp.rank + 1) * per)
        # Keyed by the global expert id, so parameter names match the checkpoint's on every rank.
        self.experts = nn.LayerDict({str(e): GatedMLP(hidden_size, intermediate_size, bias=False,
                                                      hidden_act=hidden_act, tp=SINGLE) for e in mine})
        self.other_rank_children = [f"experts.{e}" for e in range(num_experts) if e not in mine]  # see load.py
        self.__dict__["_by_id"] = [self.experts[str(e)] if e in mine else None for e in range(num_experts)]

    def route(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """x [T, hidden] -> (weights [T, k], expert ids [T, k])."""
        probs = F.softmax(self.gate(x.astype("float32")), axis=-1)
        return select_experts(probs, self.top_k, self.moe_statics.bias, self.norm_min)

    def partial(self, x: paddle.Tensor) -> paddle.Tensor:
        """This rank's experts' share of the output."""
        weights, ids = self.route(x)
        return grouped_expert_forward(x, weights.astype(x.dtype), ids, self._by_id)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.tp.all_reduce(self.partial(x))
