"""Qwen2 / Qwen2.5 decoder: RMSNorm, rotary on (x[i], x[i + D/2]) halves, GQA with q/k/v biases (no
o_proj bias), SiLU-gated MLP, untied LM head unless the config ties it. HF layout (`model.*`). Qwen3
(qwen3.py) changes only the attention options: per-head q/k RMSNorm and no biases.
"""
from __future__ import annotations

from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.models.decoder import CausalLM


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


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        check_no_sliding_window(config)
        super().__init__(config)

    @staticmethod
    def attention_options(config: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
