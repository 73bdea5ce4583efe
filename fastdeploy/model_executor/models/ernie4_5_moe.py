"""ERNIE-4.5 MoE decoder (ERNIE-4.5-21B-A3B, -300B-A47B): the dense ERNIE-4.5 layers with the MLP of
some layers replaced by routed experts plus always-on shared experts.

config.json fields (names as in the -PT and -Paddle repos; defaults as transformers' Ernie4_5_MoeConfig):
  moe_num_experts, moe_k (experts per token), moe_intermediate_size    required
  moe_num_shared_experts (2): one shared MLP of width moe_intermediate_size x this count
  moe_layer_start_index (1), moe_layer_end_index (-1: the last layer), moe_layer_interval (1):
      layer i is MoE when start <= i <= end and (i + 1) % interval == 0; the others are dense
  moe_norm_min (1e-12): floor of the routing-weight sum when renormalising over the chosen k
Checkpoint tensors per MoE layer (HF names; Paddle: `ernie.` prefix, fused up_gate_proj, [in, out]):
  mlp.gate.weight [E, hidden], mlp.moe_statics.e_score_correction_bias [1, E],
  mlp.experts.K.{gate,up,down}_proj.weight, mlp.shared_experts.{gate,up,down}_proj.weight.
Multi-token-prediction tensors (`mtp_*`) are skipped, as transformers does, unless MTP drafts (ernie4_5_mtp.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from paddle import nn

from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.layers.moe import SparseMoE
from fastdeploy.model_executor.models.decoder import dense_mlp
from fastdeploy.model_executor.models.ernie4_5 import Ernie4_5ForCausalLM


@dataclass(frozen=True, slots=True)
class ErnieMoeSettings:
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    layer_start: int
    layer_end: int  # inclusive, already resolved from -1
    layer_interval: int
    norm_min: float

    @classmethod
    def from_config(cls, config: ModelConfig) -> ErnieMoeSettings:
        fields = config.fields()
        for name in ("moe_num_experts", "moe_layer_start_index", "moe_intermediate_size"):
            if isinstance(config.hf_config.get(name), list):
                raise ValueError(f"{fields.file}: field '{name}' is a list (a multimodal ERNIE-4.5-VL config); "
                                 f"Ernie4_5_MoeForCausalLM needs a single integer")
        gate_act = config.hf_config.get("moe_gate_act", "softmax")
        if gate_act != "softmax":
            raise ValueError(f"{fields.file}: field 'moe_gate_act' must be 'softmax', got {gate_act!r}")
        num_layers = config.num_hidden_layers
        num_experts = fields.get_int("moe_num_experts")
        top_k = fields.get_int("moe_k")
        if top_k > num_experts:
            raise ValueError(f"{fields.file}: field 'moe_k' ({top_k}) must not exceed 'moe_num_experts' "
                             f"({num_experts})")
        end = fields.get_int("moe_layer_end_index", default=-1, minimum=-1)
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=fields.get_int("moe_intermediate_size"),
            num_shared_experts=fields.get_int("moe_num_shared_experts", default=2, minimum=0),
            layer_start=fields.get_int("moe_layer_start_index", default=1, minimum=0),
            layer_end=num_layers - 1 if end == -1 else end,
            layer_interval=fields.get_int("moe_layer_interval", default=1),
            norm_min=fields.get_float("moe_norm_min", default=1e-12),
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.layer_start <= layer_idx <= self.layer_end
                and (layer_idx + 1) % self.layer_interval == 0)


def ernie_moe_mlp(config: ModelConfig, moe: ErnieMoeSettings) -> SparseMoE:
    """Routed experts plus the shared experts' MLP (moe_intermediate_size x moe_num_shared_experts)."""
    return SparseMoE(config.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                     norm_min=moe.norm_min, hidden_act=config.hidden_act,
                     shared_intermediate_size=moe.intermediate_size * moe.num_shared_experts,
                     shared_bias=config.use_bias)


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        self.moe = ErnieMoeSettings.from_config(config)
        super().__init__(config)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Layer:
        if self.moe.is_moe_layer(layer_idx):
            return ernie_moe_mlp(config, self.moe)
        return dense_mlp(config, layer_idx)

    def make_mtp_moe_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Layer:
        """The MTP layer's experts (ernie4_5_mtp.py): shaped as the model's MoE layers."""
        return ernie_moe_mlp(config, self.moe)
