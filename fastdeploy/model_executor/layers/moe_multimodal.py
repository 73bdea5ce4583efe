"""ERNIE-4.5-VL's MoE layer: two expert sets (text, vision) with their own routers and FFN widths, and
shared experts on every token.

A token of type 0 (text) is routed by `gate.weight` and correction-bias row 0 among the text experts
`experts.0 .. E_t-1`; a token of type 1 or 2 (image / video: placeholders and their start / end tokens)
by `gate.weight_1` and bias row 1 among the vision experts `experts.E_t .. E_t+E_v-1`. Routing is
transformers' (softmax in float32, top-k of probs + bias, weights renormalised over the chosen k). Each
set is one `ops.fused_moe` call over its own rows, with the shared experts fused into both calls, so
every row's output is, as in transformers and FastDeploy: its routed experts' weighted outputs summed in
ascending expert id, then + shared(x). A row's result does not depend on which other rows are in the
batch (fused_moe computes rows independently), so chunking or batching a prompt changes nothing.

Checkpoint tensors (both layouts): `gate.weight` and `gate.weight_1` stored [hidden, E] float32 in -PT
and -Paddle alike (transformers transposes them when it loads), `moe_statics.e_score_correction_bias`
[2, E] (row 0 text, row 1 vision), `experts.K.*` and `shared_experts.*`.

Tensor parallel: as `SparseMoE`, routers replicated, rank r keeps an equal share of each expert set
(whole experts) and a column/row slice of the shared experts; `forward` all-reduces the rank's share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import ops
from fastdeploy.distributed.parallel_state import TPGroup, current_tp
from fastdeploy.model_executor.layers.linear import GatedMLP
from fastdeploy.model_executor.layers.moe import FusedExperts, MoEStatics
from fastdeploy.model_executor.layers.packed import PackedParameter, WeightSlot, add_slot


@dataclass(slots=True)
class ModalitySplit:
    """Which rows of a step go to which expert set; built once per step, used by every MoE layer."""

    text: paddle.Tensor | None  # [Nt] int64 row indices (None: no text rows)
    vision: paddle.Tensor | None  # [Nv] int64
    inverse: paddle.Tensor | None  # [T] rows of concat(text rows, vision rows) back in step order

    @classmethod
    def from_token_types(cls, token_types: np.ndarray | None) -> ModalitySplit:
        """token_types [T] (0 text, 1 image, 2 video); None means every row is text."""
        if token_types is None or not np.any(token_types):
            return cls(None, None, None)
        vision = np.flatnonzero(token_types != 0)
        text = np.flatnonzero(token_types == 0)
        if not text.size:
            return cls(None, paddle.to_tensor(vision), None)
        inverse = np.argsort(np.concatenate([text, vision]), kind="stable")
        return cls(paddle.to_tensor(text), paddle.to_tensor(vision), paddle.to_tensor(inverse))

    @property
    def all_text(self) -> bool:
        return self.vision is None

    @property
    def all_vision(self) -> bool:
        return self.text is None and self.vision is not None


class DualRouter(nn.Layer):
    """`weight` (text) and `weight_1` (vision) routers [hidden, E], float32, never quantized."""

    def __init__(self, hidden_size: int, num_experts: tuple[int, int]) -> None:
        super().__init__()
        self.text = PackedParameter(hidden_size, num_experts[0], role="router")
        self.vision = PackedParameter(hidden_size, num_experts[1], role="router")
        for name, target, experts in (("weight", self.text, num_experts[0]), ("weight_1", self.vision, num_experts[1])):
            # Stored [hidden, E] in both layouts: not transposed with the other linear weights, and not
            # counted when load.py tells the layouts apart.
            add_slot(self, name, WeightSlot(target, [hidden_size, experts], self.loader, linear_in_out=False))

    @staticmethod
    def loader(slot: WeightSlot, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"a router has no parts (got shard {shard_id!r})")
        if list(array.shape) != slot.global_shape:
            raise ValueError(f"router: got shape {list(array.shape)}, the model expects {slot.global_shape} "
                             f"([hidden, experts])")
        slot.target.fill(array)


class ModalityExperts(nn.Layer):
    """This rank's text and vision experts as two stacked `FusedExperts`; their checkpoint slots are
    registered here so that both sets keep the checkpoint's names `experts.K.*` (K global)."""

    def __init__(self, hidden_size: int, widths: tuple[int, int], num_experts: tuple[int, int], tp: TPGroup) -> None:
        super().__init__()
        for count in num_experts:
            tp.check_divides(count, "the number of experts of each modality")
        per = [count // tp.size for count in num_experts]
        self.text = FusedExperts(hidden_size, widths[0], tp.rank * per[0], per[0])
        self.vision = FusedExperts(hidden_size, widths[1], num_experts[0] + tp.rank * per[1], per[1])
        for sub in (self.text, self.vision):
            for name, slot in sub.__dict__.pop("weight_slots").items():
                add_slot(self, name, slot)
        local = set(range(self.text.start, self.text.start + per[0]))
        local |= set(range(self.vision.start, self.vision.start + per[1]))
        self.elsewhere = [e for e in range(sum(num_experts)) if e not in local]


class MultimodalMoE(nn.Layer):
    def __init__(self, hidden_size: int, widths: tuple[int, int], num_experts: tuple[int, int], top_k: int,
                 norm_min: float | None, shared_intermediate_size: int, hidden_act: str = "silu",
                 shared_bias: bool = False, tp: TPGroup | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= min(num_experts):
            raise ValueError(f"top_k must be in [1, {min(num_experts)}], got {top_k}")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        self.tp = tp if tp is not None else current_tp()
        self.num_experts, self.top_k, self.norm_min = num_experts, top_k, norm_min
        self.gate = DualRouter(hidden_size, num_experts)
        if num_experts[0] != num_experts[1]:
            # One [2, E] tensor holds both correction-bias rows; no checkpoint with different set sizes is known.
            raise NotImplementedError(f"text and vision expert counts differ ({num_experts}): the correction "
                                      f"bias layout for that is unknown")
        self.moe_statics = MoEStatics(num_experts[0], rows=2)
        self.experts = ModalityExperts(hidden_size, widths, num_experts, self.tp)
        # Checkpoint tensors of other ranks' experts are not read here (see load.py).
        self.other_rank_children = [f"experts.{e}" for e in self.experts.elsewhere]
        self.shared_experts = None
        if shared_intermediate_size:
            self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, bias=shared_bias,
                                           hidden_act=hidden_act, tp=self.tp)

    def _routed(self, x: paddle.Tensor, modality: int) -> paddle.Tensor:
        """One expert set over its rows x, plus the shared experts when they can be fused."""
        router, experts = (self.gate.text, self.experts.text) if modality == 0 else (self.gate.vision,
                                                                                    self.experts.vision)
        shared = self.shared_experts
        fused = shared is not None and shared.up_gate_proj.bias is None and shared.down_proj.bias is None
        start = experts.start - (0 if modality == 0 else self.num_experts[0])  # within its set
        out = ops.fused_moe(x, router.value, self.moe_statics.bias(modality), experts.up_gate.value,
                            experts.down.value, self.top_k, self.norm_min, start, self.num_experts[modality],
                            shared.up_gate_proj.packed if fused else None, shared.down_proj.packed if fused else None)
        if shared is not None and not fused:
            out = out + shared(x, reduce=False)  # still routed first, then shared
        return out

    def partial(self, x: paddle.Tensor, split: ModalitySplit) -> paddle.Tensor:
        """This rank's share of the layer's output for x [T, hidden]."""
        if split.all_text:
            return self._routed(x, 0)
        if split.all_vision:
            return self._routed(x, 1)
        text = self._routed(paddle.gather(x, split.text), 0)
        vision = self._routed(paddle.gather(x, split.vision), 1)
        return paddle.gather(paddle.concat([text, vision]), split.inverse)

    def forward(self, x: paddle.Tensor, split: ModalitySplit) -> paddle.Tensor:
        return self.tp.all_reduce(self.partial(x, split))
