"""Inspecting a loaded model's weights: each one as float32 (packed ones unpacked) and their bytes.

The formats themselves are chosen in layers/packed.py, when loading starts."""
from __future__ import annotations

import numpy as np
from paddle import nn

from fastdeploy.model_executor.layers.packed import named_slots, packed_parameters


def named_weights(model: nn.Layer) -> dict[str, np.ndarray]:
    """Every weight as float32 numpy under its checkpoint-style name (this rank's shard), packed ones
    unpacked; for inspection and tests."""
    out = {name: p.numpy() for name, p in model.named_parameters()}
    out.update((name, slot.dense()) for name, slot in named_slots(model))
    return out


def weight_bytes(model: nn.Layer) -> int:
    """Bytes the model's weights take: float32 parameters plus packed weights (a shared one once)."""
    total = sum(int(np.prod(p.shape)) * 4 for p in model.parameters())
    return total + sum(w.value.nbytes for w in packed_parameters(model) if w.value is not None)
