"""Rotary position embedding, computed per step from the token positions (see fastdeploy.ops.rotary).

Two pairings exist: ERNIE-4.5 rotates adjacent pairs (x[2i], x[2i+1]) ("interleaved", GLM style in
transformers' modeling_ernie4_5), Llama/Qwen rotate (x[i], x[i + D/2]) ("neox" halves). Both use
frequency i for pair i. The inverse frequencies are the model's (`rope_inv_freq`: plain theta^(-2i/D), or
Llama 3's scaled ones), made once at build as float32 numpy; the layer path and the compiled step's cos/sin
tables (compiled_description.py) both take them from here. cos/sin are computed from float32 positions like
transformers, once per step for all layers, so no table bounded by max_position_embeddings is kept.
"""
from __future__ import annotations

import math

import numpy as np
import paddle

from fastdeploy import ops
from fastdeploy.model_executor.model_config import Llama3RopeScaling, ModelConfig

CosSin = tuple[paddle.Tensor, paddle.Tensor]


def llama3_inv_freq(inv_freq: np.ndarray, scaling: Llama3RopeScaling) -> np.ndarray:
    """Llama 3.1's scaled inverse frequencies, in float32 with transformers' operations and their order
    (`_compute_llama3_parameters`), so the table is the same bits: long wavelengths divided by `factor`,
    short ones kept, the band between interpolated."""
    f32 = np.float32
    inv_freq = np.asarray(inv_freq, dtype=f32)
    factor, low = f32(scaling.factor), f32(scaling.low_freq_factor)
    original = scaling.original_max_position_embeddings
    # torch computes scalar / tensor as reciprocal(tensor) * scalar; the thresholds are float32 scalars.
    low_wavelen = f32(original / scaling.low_freq_factor)
    high_wavelen = f32(original / scaling.high_freq_factor)
    wavelen = (f32(1) / inv_freq) * f32(2 * math.pi)
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = ((f32(1) / wavelen) * f32(original) - low) / f32(scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """The model's inverse frequencies, float32 [head_dim / 2]."""
    inv_freq = ops.default_inv_freq(config.head_dim, config.rope_theta)
    return inv_freq if config.rope_scaling is None else llama3_inv_freq(inv_freq, config.rope_scaling)


class RotaryEmbedding:
    def __init__(self, inv_freq: np.ndarray, interleaved: bool) -> None:
        inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float32)
        if inv_freq.ndim != 1 or inv_freq.size < 1:
            raise ValueError(f"inv_freq must be a 1-D table of head_dim / 2 frequencies, got shape {inv_freq.shape}")
        self.head_dim = 2 * inv_freq.size
        self.inv_freq = inv_freq  # numpy, the model's table
        self._inv_freq = paddle.to_tensor(inv_freq)
        self.interleaved = interleaved

    def cos_sin(self, positions: paddle.Tensor) -> CosSin:
        """positions [T] -> cos, sin [T, D/2]."""
        return ops.rotary_cos_sin(positions, self._inv_freq)

    def apply_(self, q: paddle.Tensor, k: paddle.Tensor, cos_sin: CosSin) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Rotates q [T, H, D] and k [T, KVH, D] in place (made contiguous first if needed)."""
        q = q if q.is_contiguous() else q.contiguous()
        k = k if k.is_contiguous() else k.contiguous()
        return ops.apply_rotary_(q, k, *cos_sin, self.interleaved)
