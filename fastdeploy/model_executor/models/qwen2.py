"""Qwen2 / Qwen2.5 decoder: RMSNorm, rotary on (x[i], x[i + D/2]) halves, GQA with q/k/v biases (no
o_proj bias), SiLU-gated MLP, untied LM head unless the config ties it. HF layout (`model.*`); q/k/v
and gate/up load into fused `qkv_proj` / `up_gate_proj` as for ERNIE-4.5. Qwen3 (qwen3.py) reuses
these classes with per-head q/k RMSNorm and no biases.
"""
from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy.engine.model_config import ModelConfig
from fastdeploy.model_executor.layers.attention import Attention
from fastdeploy.model_executor.layers.embeddings import LMHead, VocabEmbedding
from fastdeploy.distributed.parallel_state import current_tp, kv_heads_per_rank
from fastdeploy.model_executor.layers.linear import GatedMLP, MergedLinear, RowParallelLinear, qkv_slices
from fastdeploy.model_executor.layers.norm import RMSNorm
from fastdeploy.model_executor.layers.rotary import RotaryEmbedding


def check_no_sliding_window(config: ModelConfig) -> None:
    """Sliding-window layers would need another attention mask; real Qwen2/3 configs switch them off."""
    raw = config.hf_config
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list):
        sliding = "sliding_attention" in layer_types
    else:
        # transformers: with use_sliding_window, layers from max_window_layers on use the window.
        sliding = bool(raw.get("use_sliding_window")) and raw.get("sliding_window") is not None and \
            raw.get("max_window_layers", config.num_hidden_layers) < config.num_hidden_layers
    if sliding:
        raise ValueError(f"{config.fields().file}: sliding-window attention layers are not supported "
                         f"(set use_sliding_window to false)")


class Qwen2Attention(nn.Layer):
    def __init__(self, config: ModelConfig, layer_idx: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        tp = current_tp()
        heads, kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads = heads // tp.size, kv_heads_per_rank(kv_heads, tp.size)  # this rank's
        q_size, kv_size = heads * self.head_dim, kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias,
                                     shard_names=["q", "k", "v"], slices=qkv_slices(heads, kv_heads, self.head_dim, tp))
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=o_bias)
        # Qwen3: RMSNorm over each head's vector (weight [head_dim]), before the rotary embedding.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, layer_idx)

    def forward(self, hidden: paddle.Tensor, rotary: RotaryEmbedding,
                cos_sin: tuple[paddle.Tensor, paddle.Tensor]) -> paddle.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape([-1, self.num_heads, self.head_dim])
        k = k.reshape([-1, self.num_kv_heads, self.head_dim])
        v = v.reshape([-1, self.num_kv_heads, self.head_dim])
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
        return self.o_proj(self.attn(q, k, v))


class Qwen2DecoderLayer(nn.Layer):
    def __init__(self, config: ModelConfig, layer_idx: int, attention: dict[str, bool]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, layer_idx, **attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=False, hidden_act=config.hidden_act)

    def forward(self, hidden: paddle.Tensor, residual: paddle.Tensor | None, rotary: RotaryEmbedding,
                cos_sin: tuple[paddle.Tensor, paddle.Tensor]) -> tuple[paddle.Tensor, paddle.Tensor]:
        # The residual add is folded into the next norm: returns (block output, running residual).
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen2Model(nn.Layer):
    def __init__(self, config: ModelConfig, attention: dict[str, bool]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([Qwen2DecoderLayer(config, i, attention) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, interleaved=False)

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rotary, cos_sin)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen2ForCausalLM(nn.Layer):
    # Checkpoint module name -> (our fused module, its part).
    packed_modules_mapping: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("up_gate_proj", "gate"),
        "up_proj": ("up_gate_proj", "up"),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_no_sliding_window(config)
        self.config = config
        self.model = Qwen2Model(config, self.attention_options(config))
        self.lm_head = LMHead(config.hidden_size, config.vocab_size,
                              tied_embedding=self.model.embed_tokens if config.tie_word_embeddings else None)

    @staticmethod
    def attention_options(config: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        """input_ids, positions [T] int64 (the step's ragged batch) -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).astype("float32")
