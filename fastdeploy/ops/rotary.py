"""Rotary position embedding applied in place to q and k.

Two pairings: "interleaved" rotates (x[2i], x[2i+1]) (ERNIE-4.5), "neox" rotates (x[i], x[i + D/2])
(Llama, Qwen); pair i turns by position * inv_freq[i] in both. The model owns its inverse frequencies
(theta^(-2i/D), `default_inv_freq`, or a scaled table such as Llama 3's), made once at build; cos/sin
depend only on the positions and that table, so a model computes them once per step (`rotary_cos_sin`)
and every layer applies them.
"""
from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.ops.build import call_op, compiled


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """theta^(-2i/D) for pairs i < D/2, float32 [D/2]: float32 exponent and power, as transformers computes it."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)


def rotary_cos_sin(positions: paddle.Tensor, inv_freq: paddle.Tensor | np.ndarray
                   ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """positions [T] (int), inv_freq [D/2] float32 -> cos, sin [T, D/2] float32 of position * inv_freq."""
    if isinstance(inv_freq, np.ndarray):
        inv_freq = paddle.to_tensor(np.ascontiguousarray(inv_freq, dtype=np.float32))
    if inv_freq.ndim != 1 or inv_freq.shape[0] < 1 or inv_freq.dtype != paddle.float32:
        raise ValueError(f"inv_freq must be a 1-D float32 table of D/2 frequencies, got shape "
                         f"{list(inv_freq.shape)} {inv_freq.dtype}")
    freqs = positions.astype("float32").unsqueeze(-1) * inv_freq
    return paddle.cos(freqs), paddle.sin(freqs)


def _rotate_reference(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, interleaved: bool) -> paddle.Tensor:
    t, h, d = x.shape
    cos, sin = cos.reshape([t, 1, d // 2]), sin.reshape([t, 1, d // 2])
    if interleaved:
        pairs = x.reshape([t, h, d // 2, 2])
        x1, x2 = pairs[..., 0], pairs[..., 1]
        return paddle.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape([t, h, d])
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_rotary_reference(q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor,
                           interleaved: bool) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Pure Paddle, out of place: rotated copies of q [T, H, D] and k [T, KVH, D]."""
    return _rotate_reference(q, cos, sin, interleaved), _rotate_reference(k, cos, sin, interleaved)


def apply_rotary_(q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, interleaved: bool,
                  *, use_compiled: bool = True) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Rotates q [T, H, D] and k [T, KVH, D] (float32, contiguous) in place; returns them."""
    lib = compiled(use_compiled)
    if lib is None:
        q_new, k_new = apply_rotary_reference(q, k, cos, sin, interleaved)
        paddle.assign(q_new, output=q)
        paddle.assign(k_new, output=k)
        return q, k
    call_op(lib, "fd_rotary", q, k, cos, sin, bool(interleaved))
    return q, k


def rotary_embedding_(positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor,
                      inv_freq: paddle.Tensor | np.ndarray, interleaved: bool, *, use_compiled: bool = True
                      ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Rotates q and k in place for `positions` [T] by the inverse frequencies `inv_freq` [D/2]."""
    if int(inv_freq.shape[0]) * 2 != q.shape[-1]:
        raise ValueError(f"inv_freq has {inv_freq.shape[0]} frequencies; head_dim {q.shape[-1]} needs "
                         f"{q.shape[-1] // 2}")
    cos, sin = rotary_cos_sin(positions, inv_freq)
    return apply_rotary_(q, k, cos, sin, interleaved, use_compiled=use_compiled)
