"""Qwen3-MoE decoder (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm, `head_dim`,
biases only with `attention_bias`) with the MLP of most layers replaced by routed experts, as transformers'
Qwen3MoeSparseMoeBlock: softmax over all experts' router logits in float32, the top `num_experts_per_tok`
chosen and, when `norm_topk_prob`, renormalised over the chosen k (else weighted by their plain
probabilities). No shared experts, no score-correction bias.

config.json fields (defaults as transformers' Qwen3MoeConfig):
  num_experts (transformers 5 writes it as num_local_experts), num_experts_per_tok,
  moe_intermediate_size                                                 required
  norm_topk_prob (false), decoder_sparse_step (1), mlp_only_layers ([]):
      layer i is MoE when i is not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0;
      the others are dense MLPs of intermediate_size
Checkpoint tensors per MoE layer (the hub's layout, which transformers 5's save_pretrained writes too):
  mlp.gate.weight [E, hidden], mlp.experts.K.{gate,up,down}_proj.weight.
Refused with a ValueError: sliding-window attention (use_sliding_window with a sliding_window) and
shared experts (Qwen2-MoE's shared_expert_intermediate_size), which this model class does not compute.
"""
from __future__ import annotations

from dataclasses import dataclass

from paddle import nn

from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.layers.moe import SparseMoE
from fastdeploy.model_executor.models.decoder import dense_mlp
from fastdeploy.model_executor.models.qwen3 import Qwen3ForCausalLM


def _num_experts(config: ModelConfig) -> int:
    """`num_experts` (the hub's configs) or its transformers 5 spelling `num_local_experts`; both must agree."""
    fields, raw = config.fields(), config.hf_config
    given = [name for name in ("num_experts", "num_local_experts") if raw.get(name) is not None]
    if not given:
        raise ValueError(f"{fields.file}: required field 'num_experts' (or 'num_local_experts') is missing")
    values = {name: fields.get_int(name, minimum=0) for name in given}
    if len(set(values.values())) > 1:
        raise ValueError(f"{fields.file}: fields 'num_experts' ({values['num_experts']}) and 'num_local_experts' "
                         f"({values['num_local_experts']}) disagree")
    return values[given[0]]


@dataclass(frozen=True, slots=True)
class Qwen3MoeSettings:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: frozenset[int]

    @classmethod
    def from_config(cls, config: ModelConfig) -> Qwen3MoeSettings:
        fields, raw = config.fields(), config.hf_config
        num_experts = _num_experts(config)
        top_k = fields.get_int("num_experts_per_tok")
        if num_experts and top_k > num_experts:
            raise ValueError(f"{fields.file}: field 'num_experts_per_tok' ({top_k}) must not exceed 'num_experts' "
                             f"({num_experts})")
        only = raw.get("mlp_only_layers") or []
        layers = config.num_hidden_layers
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                                 for i in only):
            raise ValueError(f"{fields.file}: field 'mlp_only_layers' must be a list of layer indices in "
                             f"[0, {layers}), got {only!r}")
        return cls(num_experts=num_experts, top_k=top_k,
                   intermediate_size=fields.get_int("moe_intermediate_size"),
                   norm_topk_prob=fields.get_bool("norm_topk_prob", default=False),
                   decoder_sparse_step=fields.get_int("decoder_sparse_step", default=1),
                   mlp_only_layers=frozenset(only))

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


def check_supported(config: ModelConfig) -> None:
    """Settings transformers' Qwen3-MoE (or a related config) may carry that this class cannot compute."""
    raw, file = config.hf_config, config.fields().file
    # transformers' Qwen3MoeConfig: with use_sliding_window, every layer attends within sliding_window.
    if raw.get("use_sliding_window") and raw.get("sliding_window") is not None:
        raise ValueError(f"{file}: sliding-window attention (use_sliding_window with sliding_window "
                         f"{raw['sliding_window']}) is not supported; set use_sliding_window to false")
    for name in ("shared_expert_intermediate_size", "num_shared_experts", "n_shared_experts"):
        if raw.get(name):
            raise ValueError(f"{file}: field '{name}' ({raw[name]!r}): shared experts are not part of "
                             f"Qwen3MoeForCausalLM; only 0 or absent is supported")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        check_supported(config)
        self.moe = Qwen3MoeSettings.from_config(config)
        super().__init__(config)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Layer:
        if not self.moe.is_moe_layer(layer_idx):
            return dense_mlp(config, layer_idx)
        # norm_min 0: the fused op divides by the chosen weights' sum itself (never 0: each is a softmax share),
        # exactly transformers' renormalisation; None leaves them unnormalised.
        return SparseMoE(config.hidden_size, self.moe.intermediate_size, self.moe.num_experts, self.moe.top_k,
                         norm_min=0.0 if self.moe.norm_topk_prob else None, hidden_act=config.hidden_act,
                         correction_bias=False)
