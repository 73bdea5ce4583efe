"""Which packed format each linear weight gets after loading, and the packing pass itself.

Without quantization a weight keeps its checkpoint precision: bf16-stored tensors are packed as bf16
(exact, half the bytes of float32), anything else as fp32. `quantization="wint8"` packs every
quantizable linear layer as int8 per output channel, `"wint4"` as int4 in groups of 128; the LM head
is int8 under both (its logits decide every token, and llama.cpp keeps it above 4 bits for the same
reason). MoE routers are never quantized.
"""
from __future__ import annotations

import logging

import numpy as np
from paddle import nn

from fastdeploy.model_executor.layers.embeddings import LMHead
from fastdeploy.model_executor.layers.linear import PackedMatmul

logger = logging.getLogger(__name__)

QUANTIZED_FORMATS = {"wint8": "int8", "wint4": "int4"}


def weight_format(layer: PackedMatmul, quantization: str | None) -> str:
    if quantization is not None and layer.quantizable:
        return "int8" if isinstance(layer, LMHead) else QUANTIZED_FORMATS[quantization]
    return "bf16" if layer.stored_bf16() else "fp32"


def pack_weights(model: nn.Layer, quantization: str | None) -> None:
    """Repack every linear weight of a loaded model for the compiled weight-only GEMM (`quantization`
    as validated by EngineConfig)."""
    counts: dict[str, int] = {}
    for _, layer in model.named_sublayers(include_self=True):
        if isinstance(layer, PackedMatmul) and layer.packed is None:
            fmt = weight_format(layer, quantization)
            layer.pack(fmt)
            counts[fmt] = counts.get(fmt, 0) + 1
    logger.info("packed linear weights: %s", ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items())))


def named_weights(model: nn.Layer) -> dict[str, np.ndarray]:
    """Every weight as float32 numpy under its parameter name, packed ones unpacked; for inspection."""
    out = {name: p.numpy() for name, p in model.named_parameters()}
    for name, layer in model.named_sublayers():
        if isinstance(layer, PackedMatmul) and layer.packed is not None:
            if not (isinstance(layer, LMHead) and layer.tied):
                out[f"{name}.weight"] = layer.dense_weight()
    return out


def weight_bytes(model: nn.Layer) -> int:
    """Bytes the model's weights take: float32 parameters plus packed weights."""
    total = sum(int(np.prod(p.shape)) * 4 for p in model.parameters())
    for _, layer in model.named_sublayers():
        if isinstance(layer, PackedMatmul) and layer.packed is not None:
            total += layer.packed.nbytes
    return total
