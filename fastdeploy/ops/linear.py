"""Weight-only linear y = x @ W with W packed by `fastdeploy.ops.pack.pack_weight`.

fp32 weights are computed in float32 with one FMA chain per output; bf16 weights take the activations
rounded to bf16 (as a GPU's bf16 GEMM) and accumulate in float32 (AVX512_BF16's dot product where the CPU
has it, the same bits from FMAs elsewhere). For int8 and int4 the activations are quantized per row per
32-k block to int8 (like llama.cpp's Q8_0) and multiplied with exact int32 VNNI dot products; the blocks'
sums are then scaled and added in float32. Either way a row's result does not depend on the other rows in
the batch (same bits for T = 1 and T = 2048).
"""
from __future__ import annotations

import paddle

from fastdeploy.ops.build import call_op, compiled
from fastdeploy.ops.quant import FORMATS, PackedWeight, quantize_activations_reference, unpack_weight


def weight_only_linear_reference(x: paddle.Tensor, weight: PackedWeight, quantize_activations: bool = True
                                 ) -> paddle.Tensor:
    """Pure Paddle. x [..., K] float32 -> [..., N]. `quantize_activations` reproduces the kernels' activation
    rounding (int8/int4: per 32-k block; bf16: to bf16); False gives the plain dequantized-weight product."""
    lead = list(x.shape[:-1])
    x2 = x.reshape([-1, weight.k])
    if quantize_activations:
        y = paddle.matmul(_as_kernels_see(x2, weight), unpack_weight(weight, padded=True))
    else:
        y = paddle.matmul(x2, unpack_weight(weight))
    return y.reshape(lead + [weight.n])


def _as_kernels_see(x: paddle.Tensor, weight: PackedWeight) -> paddle.Tensor:
    """x [T, K] rounded as the kernels round it for this weight's format (zero-padded to its padded K):
    int8 / int4 per 32-k block to int8, bf16 to bf16, fp32 not at all."""
    if weight.fmt in ("int8", "int4"):
        return quantize_activations_reference(x, weight.k_padded)
    return x.astype("bfloat16").astype("float32") if weight.fmt == "bf16" else x


def weight_only_linear(x: paddle.Tensor, weight: PackedWeight, *, use_compiled: bool = True) -> paddle.Tensor:
    """x [..., K] float32 -> x @ W [..., N] float32 (no bias: add it outside)."""
    shape = x.shape
    if not isinstance(weight, PackedWeight):
        raise TypeError(f"weight must be a PackedWeight (see fastdeploy.ops.pack.pack_weight), got {type(weight)}")
    if x.dtype != paddle.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    if not shape or shape[-1] != weight.k:
        raise ValueError(f"x's last dimension must be in_features = {weight.k}, got shape {shape}")
    lead = shape[:-1]
    x2 = x if len(shape) == 2 else x.reshape([-1, weight.k])
    lib = compiled(use_compiled)
    if lib is None:
        # Without the compiled kernels, keep the dense matrix after the first call instead of unpacking
        # it for every token (memory as for fp32 weights, numerics as the kernels').
        if weight.dense_cache is None:
            weight.dense_cache = unpack_weight(weight, padded=True)
        y = paddle.matmul(_as_kernels_see(x2, weight), weight.dense_cache)
    else:
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = call_op(lib, "fd_linear", x2, weight.data, weight.scales, FORMATS[weight.fmt], int(weight.n))[0]
    return y if len(shape) == 2 else y.reshape(lead + [weight.n])
