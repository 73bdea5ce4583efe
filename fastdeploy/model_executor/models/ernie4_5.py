"""ERNIE-4.5 dense decoder (the 0.3B): RMSNorm, interleaved rotary, GQA, SiLU-gated MLP, optional
linear biases (`use_bias`), usually tied embeddings.

Parameter names follow the Paddle checkpoints (fused `qkv_proj` and `up_gate_proj`); load.py maps
HF's separate q/k/v and gate/up onto them. The MoE variant (ernie4_5_moe.py) only replaces some
layers' MLP.
"""
from __future__ import annotations

from fastdeploy.model_executor.models.decoder import CausalLM


class Ernie4_5ForCausalLM(CausalLM):
    interleaved_rotary = True
    # Prefix of the decoder's tensors in Paddle checkpoints, used instead of HF's "model.".
    paddle_prefix = "ernie."
    # The multi-token-prediction head (mtp_block.*, mtp_emb_norm, ...) is loaded only for MTP drafting.
    ignored_checkpoint_patterns: tuple[str, ...] = (r"(^|\.)mtp_",)
