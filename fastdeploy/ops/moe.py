"""Mixture of experts: softmax top-k routing and the experts' gated MLPs, in one compiled call.

Routing (transformers' Ernie4_5_MoeTopKRouter semantics, computed in float32):
    probs = softmax(x @ W_gate)                                [T, E]
    ids = top_k(probs + e_score_correction_bias)               the bias only steers the choice
    weights = probs[ids] / max(sum(probs[ids]), norm_min)      renormalised over the chosen k
then out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) + shared(x[t]), where an expert is
down(silu(gate) * up) of its packed weights.

Expert weights are "stacked" PackedWeights: one PackedWeight per projection whose `data` (and, for
int8 / int4, `scales`) carry a leading [E_local] dimension, the experts expert_start .. expert_start +
E_local - 1 that this tensor-parallel rank holds. Tokens routed to experts elsewhere contribute nothing
here: the result is this rank's partial sum, which the caller all-reduces.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy.ops.activation import silu_and_mul_reference
from fastdeploy.ops.build import call_op, compiled
from fastdeploy.ops.linear import weight_only_linear_reference
from fastdeploy.ops.quant import FORMATS, PackedWeight

Expert = Callable[[paddle.Tensor], paddle.Tensor]


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
                           experts: Sequence[Expert | None]) -> paddle.Tensor:
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


def _mlp_reference(x: paddle.Tensor, up_gate: PackedWeight, down: PackedWeight) -> paddle.Tensor:
    return weight_only_linear_reference(silu_and_mul_reference(weight_only_linear_reference(x, up_gate)), down)


def _local_experts(stacked: PackedWeight) -> int:
    return int(stacked.data.shape[0])


def _check(x: paddle.Tensor, router: PackedWeight, correction_bias: paddle.Tensor | None, up_gate: PackedWeight,
           down: PackedWeight, top_k: int, norm_min: float | None, expert_start: int, num_experts: int,
           shared_up_gate: PackedWeight | None, shared_down: PackedWeight | None) -> None:
    """Raises TypeError / ValueError naming the offending parameter."""
    for name, w in (("router", router), ("up_gate", up_gate), ("down", down)):
        if not isinstance(w, PackedWeight):
            raise TypeError(f"{name} must be a PackedWeight, got {type(w).__name__}")
    if not isinstance(x, paddle.Tensor) or x.dtype != paddle.float32 or len(x.shape) != 2:
        raise TypeError(f"x must be a 2-D float32 paddle.Tensor [tokens, hidden], got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    hidden = x.shape[1]
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if router.fmt not in ("fp32", "bf16") or router.k != hidden or router.n != num_experts:
        raise ValueError(f"router must be an fp32 or bf16 PackedWeight with k = hidden = {hidden} and n = "
                         f"num_experts = {num_experts}, got fmt {router.fmt!r}, k {router.k}, n {router.n}")
    if up_gate.k != hidden:
        raise ValueError(f"up_gate.k must be x's last dimension {hidden}, got {up_gate.k}")
    if up_gate.n % 2 or down.k != up_gate.n // 2:
        raise ValueError(f"up_gate.n must be 2 * down.k (gate | up), got up_gate.n {up_gate.n}, down.k {down.k}")
    if down.n != hidden:
        raise ValueError(f"down.n must be hidden = {hidden}, got {down.n}")
    if up_gate.fmt not in FORMATS or down.fmt not in FORMATS:
        raise ValueError(f"up_gate / down fmt must be one of {sorted(FORMATS)}")
    for name, w in (("up_gate", up_gate), ("down", down)):
        # One more dimension than a single packed weight: [E_local, Np, K, 16] or [E_local, Np, Kp/v, 16, 4].
        stacked_ndim = 4 if w.fmt in ("fp32", "bf16") else 5
        if len(w.data.shape) != stacked_ndim or (w.fmt in ("int8", "int4") and w.scales.shape[0] != w.data.shape[0]):
            raise ValueError(f"{name} must be a stacked PackedWeight (data [E_local, ...] with {stacked_ndim} dims, "
                             f"scales [E_local, ...]), got data {w.data.shape}, scales {w.scales.shape}")
    local = _local_experts(up_gate)
    if _local_experts(down) != local:
        raise ValueError(f"up_gate and down must stack the same number of experts, got {local} and "
                         f"{_local_experts(down)}")
    if not isinstance(expert_start, int) or expert_start < 0 or expert_start + local > num_experts:
        raise ValueError(f"expert_start ({expert_start!r}) + the {local} stacked experts must lie within "
                         f"num_experts = {num_experts}")
    if correction_bias is not None and (correction_bias.dtype != paddle.float32
                                        or math.prod(correction_bias.shape) != num_experts):
        raise ValueError(f"correction_bias must be float32 with num_experts = {num_experts} elements, got "
                         f"{correction_bias.dtype} {correction_bias.shape}")
    if norm_min is not None and not (isinstance(norm_min, (int, float)) and norm_min >= 0):
        raise ValueError(f"norm_min must be None or a float >= 0, got {norm_min!r}")
    if (shared_up_gate is None) != (shared_down is None):
        raise ValueError("shared_up_gate and shared_down must be given together (or neither)")
    if shared_up_gate is not None:
        if not isinstance(shared_up_gate, PackedWeight) or not isinstance(shared_down, PackedWeight):
            raise TypeError("shared_up_gate and shared_down must be PackedWeights")
        if (shared_up_gate.k != hidden or shared_up_gate.n % 2 or shared_down.k != shared_up_gate.n // 2
                or shared_down.n != hidden):
            raise ValueError(f"shared_up_gate must be [hidden={hidden}, 2 * I] and shared_down [I, hidden], got "
                             f"[{shared_up_gate.k}, {shared_up_gate.n}] and [{shared_down.k}, {shared_down.n}]")


def fused_moe_reference(x: paddle.Tensor, router: PackedWeight, correction_bias: paddle.Tensor | None,
                        up_gate: PackedWeight, down: PackedWeight, top_k: int, norm_min: float | None,
                        expert_start: int, num_experts: int, shared_up_gate: PackedWeight | None = None,
                        shared_down: PackedWeight | None = None, *, return_routing: bool = False
                        ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Pure Paddle: this rank's share of the MoE layer, [T, hidden] float32. With `return_routing`,
    also (ids [T, k] int64, weights [T, k] float32) of every token."""
    _check(x, router, correction_bias, up_gate, down, top_k, norm_min, expert_start, num_experts, shared_up_gate,
           shared_down)
    probs = F.softmax(weight_only_linear_reference(x, router), axis=-1)
    bias = None if correction_bias is None else correction_bias.reshape([-1])
    weights, ids = select_experts(probs, top_k, bias, norm_min)
    local = _local_experts(up_gate)
    experts: list[Expert | None] = [None] * num_experts
    for i in range(local):
        experts[expert_start + i] = lambda rows, i=i: _mlp_reference(rows, up_gate.expert(i), down.expert(i))
    out = grouped_expert_forward(x, weights, ids, experts)
    if shared_up_gate is not None:
        out = out + _mlp_reference(x, shared_up_gate, shared_down)
    return (out, ids, weights) if return_routing else out


def fused_moe(x: paddle.Tensor, router: PackedWeight, correction_bias: paddle.Tensor | None, up_gate: PackedWeight,
              down: PackedWeight, top_k: int, norm_min: float | None, expert_start: int, num_experts: int,
              shared_up_gate: PackedWeight | None = None, shared_down: PackedWeight | None = None, *,
              use_compiled: bool = True, return_routing: bool = False
              ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """This rank's share of the MoE layer in one compiled call (`fd_moe`); see the module docstring.

    x [T, hidden] float32; router: fp32/bf16 PackedWeight [hidden, num_experts]; correction_bias [E] or
    None; up_gate / down: stacked PackedWeights of the E_local experts from expert_start on; norm_min None:
    no renormalisation. Returns [T, hidden] float32 (and, with `return_routing`, ids and weights)."""
    lib = compiled(use_compiled)
    if lib is None:
        return fused_moe_reference(x, router, correction_bias, up_gate, down, top_k, norm_min, expert_start,
                                   num_experts, shared_up_gate, shared_down, return_routing=return_routing)
    _check(x, router, correction_bias, up_gate, down, top_k, norm_min, expert_start, num_experts, shared_up_gate,
           shared_down)
    if not x.is_contiguous():
        x = x.contiguous()
    bias = _EMPTY if correction_bias is None else correction_bias  # any shape with E elements
    shared = (shared_up_gate, shared_down) if shared_up_gate is not None else (up_gate, down)  # ignored if absent
    shared_fmts = ((FORMATS[shared_up_gate.fmt], FORMATS[shared_down.fmt]) if shared_up_gate is not None
                   else (-1, -1))
    out, ids, weights = call_op(
        lib, "fd_moe", x, router.data, router.scales, bias, up_gate.data, up_gate.scales, down.data, down.scales,
        shared[0].data, shared[0].scales, shared[1].data, shared[1].scales,
        int(top_k), int(num_experts), int(expert_start), int(down.k),
        int(shared_down.k) if shared_down is not None else 0,
        FORMATS[router.fmt], FORMATS[up_gate.fmt], FORMATS[down.fmt], *shared_fmts,
        float(norm_min) if norm_min is not None else 0.0, norm_min is not None)
    return (out, ids, weights) if return_routing else out


_EMPTY = paddle.zeros([0], dtype="float32")
