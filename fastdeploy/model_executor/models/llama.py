"""Llama (2, 3.x) and Mistral decoders on the shared `CausalLM`: RMSNorm, rotary on (x[i], x[i + D/2])
halves (plain, or Llama 3.1's `llama3` scaling: layers/rotary.py), GQA, SiLU-gated MLP, `head_dim` given or
hidden / heads, untied `lm_head` unless `tie_word_embeddings`. HF layout (`model.*`).

Llama's biases follow transformers' LlamaConfig: `attention_bias` on q/k/v/o, `mlp_bias` on gate/up/down
(both default false). Mistral has no bias fields (every projection bias-free) and a `sliding_window`;
EngineConfig refuses a window shorter than max_model_len, so every layer here attends to the whole context,
which is exact for a window that covers it.
"""
from __future__ import annotations

from paddle import nn

from fastdeploy.model_executor.layers.linear import GatedMLP
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict[str, bool]:
        bias = config.fields().get_bool("attention_bias", default=False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Layer:
        bias = config.fields().get_bool("mlp_bias", default=False)
        return GatedMLP(config.hidden_size, config.intermediate_size, bias, config.hidden_act)


class MistralForCausalLM(CausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Layer:
        return GatedMLP(config.hidden_size, config.intermediate_size, False, config.hidden_act)
