"""A loaded decoder model as the compiled forward step (custom_ops/decoder_step.cc) runs it, described by
the model side: which tensor is each layer's norm, bias, projection, router and expert set, which layers
are dense and which MoE, and the rotary tables. `worker/compiled_step.py` turns a description into the
library's C structures; what a model's tensors mean is decided here, next to the models, not there.

Covered: every `CausalLM` of this package (ERNIE-4.5 dense and MoE, Qwen2, Qwen3, Qwen3-MoE, Llama,
Mistral) and ERNIE-4.5-VL's text side (its text experts; steps with vision rows take the layer path). The
rotary tables are the layer path's cos/sin of every position, from the model's inverse frequencies (Llama 3's
scaled ones included). Not covered (`unsupported_reason`): tensor parallel and shared experts with biases,
which the library has no slot for.

Built once per model, so nothing here runs per step.
"""
from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass

import paddle
from paddle import nn

from fastdeploy.model_executor.layers.linear import GatedMLP
from fastdeploy.model_executor.layers.moe import SparseMoE
from fastdeploy.model_executor.layers.moe_multimodal import MultimodalMoE
from fastdeploy.ops.quant import PackedWeight


@dataclass(frozen=True, slots=True)
class CompiledMoE:
    """One MoE layer's routed experts (this rank's `local_experts` from `expert_start`) and shared MLP."""

    router: PackedWeight
    correction_bias: paddle.Tensor | None  # the library reads its first row (ERNIE-4.5-VL's: the text experts')
    experts_up_gate: PackedWeight  # stacked [E, ...]
    experts_down: PackedWeight
    shared_up_gate: PackedWeight | None
    shared_down: PackedWeight | None
    num_experts: int
    expert_start: int
    local_experts: int
    top_k: int
    norm_min: float | None  # None: the chosen weights are not renormalised


@dataclass(frozen=True, slots=True)
class CompiledLayer:
    """One decoder layer: attention, then either a dense gated MLP (`up_gate` / `down`) or `moe`."""

    input_norm: paddle.Tensor
    post_norm: paddle.Tensor
    qkv: PackedWeight
    qkv_bias: paddle.Tensor | None
    o: PackedWeight
    o_bias: paddle.Tensor | None
    q_norm: paddle.Tensor | None  # Qwen3's per-head q/k norms
    k_norm: paddle.Tensor | None
    up_gate: PackedWeight | None = None
    up_gate_bias: paddle.Tensor | None = None
    down: PackedWeight | None = None
    down_bias: paddle.Tensor | None = None
    moe: CompiledMoE | None = None

    @property
    def ffn_width(self) -> int:
        """The dense MLP's intermediate width (0 on an MoE layer): sizes the library's workspace."""
        return self.down.k if self.down is not None else 0


@dataclass(frozen=True, slots=True)
class CompiledModel:
    """The whole model: its layers, sizes, embedding, final norm, LM head and rotary cos/sin tables
    ([max_positions, head_dim] rows, made here and held by the description)."""

    layers: tuple[CompiledLayer, ...]
    hidden: int
    heads: int  # this rank's query heads
    kv_heads: int
    head_dim: int
    eps: float
    attn_scale: float
    interleaved: bool  # rotary pairs (x[2i], x[2i+1])
    embedding: PackedWeight
    lm_head: PackedWeight
    final_norm: paddle.Tensor
    cos: paddle.Tensor
    sin: paddle.Tensor
    max_positions: int
    # The MTP layer as the model: the norms of its embedding and hidden-state halves and its projection.
    mtp_emb_norm: paddle.Tensor | None = None
    mtp_hidden_norm: paddle.Tensor | None = None
    mtp_proj: PackedWeight | None = None

    @property
    def max_ffn(self) -> int:
        return max(layer.ffn_width for layer in self.layers)

    @property
    def max_top_k(self) -> int:
        return max((layer.moe.top_k for layer in self.layers if layer.moe is not None), default=0)

    @property
    def vocab(self) -> int:
        return self.lm_head.n


def unsupported_reason(model: nn.Layer, mtp: bool = False) -> str | None:
    """Why `model` (`mtp`: its MTP layer) must run layer by layer (None: the compiled step covers it)."""
    decoder = getattr(model, "model", None)
    if not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} is not a decoder CausalLM"
    if model.lm_head.tp.size != 1:
        return "tensor parallel"
    for layer in _layers(model, mtp):
        mlp = layer.mlp
        if isinstance(mlp, (SparseMoE, MultimodalMoE)):
            shared = mlp.shared_experts
            if shared is not None and (shared.up_gate_proj.bias is not None or shared.down_proj.bias is not None):
                return "shared experts with biases"
        elif not isinstance(mlp, GatedMLP):
            return f"MLP {type(mlp).__name__}"
    return None


def _moe(mlp: SparseMoE | MultimodalMoE) -> CompiledMoE:
    # ERNIE-4.5-VL: the compiled step runs text tokens only, so its text experts and their router.
    multimodal = isinstance(mlp, MultimodalMoE)
    router, experts = (mlp.gate.text.value, mlp.experts.text) if multimodal else (mlp.gate.packed, mlp.experts)
    shared = mlp.shared_experts
    return CompiledMoE(
        router=router,
        correction_bias=mlp.moe_statics.e_score_correction_bias if mlp.moe_statics is not None else None,
        experts_up_gate=experts.up_gate.value, experts_down=experts.down.value,
        shared_up_gate=shared.up_gate_proj.packed if shared is not None else None,
        shared_down=shared.down_proj.packed if shared is not None else None,
        num_experts=mlp.num_experts[0] if multimodal else mlp.num_experts, expert_start=experts.start,
        local_experts=experts.count, top_k=mlp.top_k, norm_min=mlp.norm_min)


def _layer(layer: nn.Layer) -> CompiledLayer:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
    common = dict(input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                  qkv=attn.qkv_proj.packed, qkv_bias=attn.qkv_proj.bias, o=attn.o_proj.packed, o_bias=attn.o_proj.bias,
                  q_norm=q_norm, k_norm=k_norm)
    if isinstance(mlp, GatedMLP):
        return CompiledLayer(**common, up_gate=mlp.up_gate_proj.packed, up_gate_bias=mlp.up_gate_proj.bias,
                             down=mlp.down_proj.packed, down_bias=mlp.down_proj.bias)
    return CompiledLayer(**common, moe=_moe(mlp))


def _layers(model: nn.Layer, mtp: bool) -> Sequence[nn.Layer]:
    return model.model.mtp_block if mtp else model.model.layers


def describe(model: nn.Layer, max_positions: int, mtp: bool = False) -> CompiledModel:
    """The description of a model `unsupported_reason` accepts, with rotary tables for positions
    [0, max_positions); `mtp`: its MTP layer (ernie4_5_mtp.py) as the model, its input made from hidden states."""
    cfg, decoder = model.config, model.model
    layers = _layers(model, mtp)
    # The layer path's cos/sin for every position, from the model's own inverse frequencies.
    cos, sin = decoder.rotary.cos_sin(paddle.arange(max_positions, dtype="int64"))
    attn = layers[0].self_attn
    return CompiledModel(
        layers=tuple(_layer(layer) for layer in layers), hidden=cfg.hidden_size, heads=attn.num_heads,
        kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, eps=decoder.norm.eps, attn_scale=attn.attn.scale,
        interleaved=decoder.rotary.interleaved, embedding=decoder.embed_tokens.weight.value,
        lm_head=model.lm_head.packed, final_norm=decoder.norm.weight, cos=cos, sin=sin, max_positions=max_positions,
        mtp_emb_norm=decoder.mtp_emb_norm[0].weight if mtp else None,
        mtp_hidden_norm=decoder.mtp_hidden_norm[0].weight if mtp else None,
        mtp_proj=decoder.mtp_linear_proj[0].packed if mtp else None)
