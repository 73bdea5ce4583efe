"""Qwen3 dense decoder: Qwen2's layers with RMSNorm on every query and key head (`q_norm` / `k_norm`,
weight [head_dim], applied before the rotary embedding), q/k/v/o biases only when `attention_bias`
is true (default false), and `head_dim` given on its own rather than hidden_size / heads."""
from __future__ import annotations

from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    @staticmethod
    def attention_options(config: ModelConfig) -> dict[str, bool]:
        bias = config.fields().get_bool("attention_bias", default=False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
