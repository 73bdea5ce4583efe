"""The decoder every supported family shares: pre-norm blocks of GQA attention (fused qkv_proj,
rotary, paged attention) and an MLP, RMSNorm, an embedding and an LM head (tied or not).

A family is a `CausalLM` subclass that picks the rotary pairing, the attention options (biases,
per-head q/k norm) and each layer's MLP (dense, or MoE for some layers).
"""
from __future__ import annotations

from collections.abc import Callable

import paddle
from paddle import nn

from fastdeploy.distributed.parallel_state import current_tp, kv_heads_per_rank
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.layers.attention import Attention
from fastdeploy.model_executor.layers.embeddings import LMHead, VocabEmbedding
from fastdeploy.model_executor.layers.linear import GatedMLP, MergedLinear, RowParallelLinear, qkv_slices
from fastdeploy.model_executor.layers.norm import RMSNorm
from fastdeploy.model_executor.layers.rotary import CosSin, RotaryEmbedding, rope_inv_freq

MLPFactory = Callable[[ModelConfig, int], nn.Layer]
RunMLP = Callable[[nn.Layer, paddle.Tensor], paddle.Tensor]


def dense_mlp(config: ModelConfig, layer_idx: int) -> nn.Layer:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.use_bias, config.hidden_act)


class DecoderAttention(nn.Layer):
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

    def forward(self, hidden: paddle.Tensor, rotary: RotaryEmbedding, cos_sin: CosSin) -> paddle.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.reshape([-1, self.num_heads, self.head_dim])
        k = k.reshape([-1, self.num_kv_heads, self.head_dim])
        v = v.reshape([-1, self.num_kv_heads, self.head_dim])
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.apply_(q, k, cos_sin)
        return self.o_proj(self.attn(q, k, v))


class DecoderLayer(nn.Layer):
    def __init__(self, config: ModelConfig, layer_idx: int, attention: dict[str, bool], make_mlp: MLPFactory) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, layer_idx, **attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer_idx)

    def forward(self, hidden: paddle.Tensor, residual: paddle.Tensor | None, rotary: RotaryEmbedding,
                cos_sin: CosSin, run_mlp: RunMLP | None = None) -> tuple[paddle.Tensor, paddle.Tensor]:
        """`run_mlp(mlp, x)` calls the MLP with more than x (ERNIE-4.5-VL's experts take the modality split)."""
        # The residual add is folded into the next norm: returns (block output, running residual).
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return (self.mlp(hidden) if run_mlp is None else run_mlp(self.mlp, hidden)), residual


class DecoderModel(nn.Layer):
    def __init__(self, config: ModelConfig, attention: dict[str, bool], make_mlp: MLPFactory,
                 interleaved_rotary: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([DecoderLayer(config, i, attention, make_mlp)
                                    for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(rope_inv_freq(config), interleaved=interleaved_rotary)

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        return self.decode(self.embed_tokens(input_ids), self.rotary.cos_sin(positions))

    def decode(self, hidden: paddle.Tensor, cos_sin: CosSin, run_mlp: RunMLP | None = None) -> paddle.Tensor:
        """Input embeddings [T, hidden] through every layer and the final norm."""
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, self.rotary, cos_sin, run_mlp)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Layer):
    # Checkpoint module name -> (our fused module, its part), for checkpoints with separate q/k/v, gate/up.
    packed_modules_mapping: dict[str, tuple[str, str]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("up_gate_proj", "gate"),
        "up_proj": ("up_gate_proj", "up"),
    }
    interleaved_rotary: bool = False  # rotary pairs (x[2i], x[2i+1]) instead of (x[i], x[i + D/2])

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.attention_options(config), self.make_mlp, self.interleaved_rotary)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size,
                              tied_embedding=self.model.embed_tokens if config.tie_word_embeddings else None)

    @staticmethod
    def attention_options(config: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": config.use_bias, "o_bias": config.use_bias, "qk_norm": False}

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Layer:
        """Layer `layer_idx`'s MLP (the MoE model overrides this)."""
        return dense_mlp(config, layer_idx)

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        """input_ids, positions [T] int64 (the step's ragged batch) -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).astype("float32")
