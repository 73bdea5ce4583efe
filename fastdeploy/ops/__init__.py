"""CPU custom ops (compiled from custom_ops/ on first use) with pure-Paddle reference fallbacks.

Every wrapper takes `use_compiled=True`; when the compiled library cannot be built or run here (no
compiler, no AVX2), the wrappers run the reference implementations after one logged warning.
"""
from fastdeploy.ops.activation import quick_gelu, quick_gelu_reference, silu_and_mul, silu_and_mul_reference
from fastdeploy.ops.attention import (bidirectional_attention, bidirectional_attention_reference, paged_attention,
                                      paged_attention_reference)
from fastdeploy.ops.embedding import embedding_lookup, embedding_lookup_reference
from fastdeploy.ops.build import (core_budget, library, limit_cores, runtime_info, set_isa, set_num_threads,
                                  share_cores)
from fastdeploy.ops.linear import weight_only_linear, weight_only_linear_reference
from fastdeploy.ops.memory import keep_freed_memory
from fastdeploy.ops.moe import fused_moe, fused_moe_reference, grouped_expert_forward, select_experts
from fastdeploy.ops.norm import rms_norm, rms_norm_reference
from fastdeploy.ops.pack import pack_into, pack_weight
from fastdeploy.ops.quant import (FORMATS, PackedWeight, empty_packed, pack_into_reference,
                                   pack_weight_reference, unpack_weight)
from fastdeploy.ops.rotary import (apply_rotary_, apply_rotary_reference, default_inv_freq, rotary_cos_sin,
                                   rotary_embedding_)

__all__ = [
    "FORMATS", "PackedWeight", "apply_rotary_", "apply_rotary_reference", "bidirectional_attention",
    "bidirectional_attention_reference", "core_budget", "default_inv_freq", "embedding_lookup",
    "embedding_lookup_reference", "empty_packed", "fused_moe", "fused_moe_reference", "grouped_expert_forward",
    "keep_freed_memory", "library", "limit_cores", "pack_into", "pack_into_reference", "pack_weight",
    "pack_weight_reference", "paged_attention", "paged_attention_reference", "quick_gelu", "quick_gelu_reference",
    "rms_norm", "rms_norm_reference", "rotary_cos_sin", "rotary_embedding_", "runtime_info", "set_isa",
    "set_num_threads", "share_cores", "silu_and_mul", "silu_and_mul_reference", "unpack_weight", "weight_only_linear",
    "weight_only_linear_reference", "select_experts",
]
