"""Packing linear weights for the compiled kernels: fp32, bf16, int8 per channel, int4 per group.

A weight W is the Paddle-layout [K, N] = [in_features, out_features] matrix of y = x @ W. Packing cuts
the N axis into panels of 16 output columns (the last panel zero-padded) and stores each panel
contiguously, so a kernel streams one panel per vector lane group:

  fp32  data float32  [Np, K, 16]          data[p, k, j] = W[k, 16p + j]
  bf16  data bfloat16 [Np, K, 16]          same, rounded to nearest even (or the checkpoint's bits)
  int8  data uint8    [Np, Kp/4, 16, 4]    data[p, k//4, j, k%4] = q[k, 16p + j] + 128
        scales float32 [Np * 16]           W ~ q * scales[n], q = rint(W / s) in [-127, 127], s = max|W[:, n]| / 127
  int4  data uint8    [Np, Kp/8, 16, 4]    low nibble: q[8m + r] + 8, high nibble: q[8m + 4 + r] + 8 (m = k//8, r)
        scales float32 [Np, Kp/128, 16]    per 128 k per column: s = (the value of largest magnitude) / -8,
                                           q = rint(W / s) in [-8, 7] (llama.cpp's Q4_0 rule; s may be < 0)

Np = ceil(N / 16); Kp = K rounded up to 32 (int8) or 128 (int4), the extra rows hold q = 0. Each 64-byte
vector of the int formats is 16 columns x 4 consecutive k, the operand shape of a VNNI dot product.
Quantization runs in numpy at load time; `unpack_weight` inverts it in Paddle for the references.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

PANEL = 16
ACT_BLOCK = 32
INT4_GROUP = 128
FORMATS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}


@dataclass(slots=True)
class PackedWeight:
    fmt: str  # one of FORMATS
    k: int  # in_features
    n: int  # out_features
    data: paddle.Tensor
    scales: paddle.Tensor  # float32; a 1-element placeholder for fp32 / bf16
    dense_cache: paddle.Tensor | None = field(default=None, repr=False)  # fallback path only

    @property
    def k_padded(self) -> int:
        block = {"int8": ACT_BLOCK, "int4": INT4_GROUP}.get(self.fmt, 1)
        return -(-self.k // block) * block

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass streams: packed data plus scales."""
        size = int(np.prod(self.data.shape)) * (4 if self.fmt == "fp32" else 2 if self.fmt == "bf16" else 1)
        return size + (int(np.prod(self.scales.shape)) * 4 if self.fmt in ("int8", "int4") else 0)


def _as_matrix(w: np.ndarray | paddle.Tensor) -> np.ndarray:
    if isinstance(w, paddle.Tensor):
        w = w.astype("float32").numpy() if w.dtype != paddle.float32 else w.numpy()
    w = np.asarray(w)
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"weight must be a non-empty 2-D [in_features, out_features] matrix, got shape {w.shape}")
    return w


def _pad(a: np.ndarray, rows: int, cols: int, value: float | int = 0) -> np.ndarray:
    if a.shape == (rows, cols):
        return a
    out = np.full((rows, cols), value, dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def _to_bf16_bits(w: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits, nearest even; keeps w's memory order (a transposed view stays
    transposed), and works in place on one temporary."""
    w = w.astype(np.float32, copy=False)
    bits = w.view(np.uint32) if w.flags.c_contiguous or w.flags.f_contiguous else w.copy().view(np.uint32)
    rounded = bits >> np.uint32(16)
    rounded &= np.uint32(1)
    rounded += np.uint32(0x7FFF)
    rounded += bits
    rounded >>= np.uint32(16)
    return rounded.astype(np.uint16)


def pack_weight(w: np.ndarray | paddle.Tensor, fmt: str) -> PackedWeight:
    """Quantize/pack W [K, N] (float, or for "bf16" raw bfloat16 bits as uint16) into `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    w = _as_matrix(w)
    k, n = w.shape
    np_ = -(-n // PANEL)
    placeholder = paddle.zeros([1], dtype="float32")
    if fmt in ("fp32", "bf16"):
        if fmt == "bf16":
            bits = w if w.dtype == np.uint16 else _to_bf16_bits(w)
            panels = _pad(bits, k, np_ * PANEL).reshape(k, np_, PANEL).transpose(1, 0, 2)
        else:
            panels = _pad(w.astype(np.float32), k, np_ * PANEL).reshape(k, np_, PANEL).transpose(1, 0, 2)
        return PackedWeight(fmt, k, n, paddle.to_tensor(np.ascontiguousarray(panels)), placeholder)
    if w.dtype == np.uint16:
        raise ValueError("uint16 (raw bfloat16) input is only accepted for fmt='bf16'")
    w = w.astype(np.float32)
    if fmt == "int8":
        kp = -(-k // ACT_BLOCK) * ACT_BLOCK
        scale = np.abs(w).max(axis=0) / np.float32(127)
        q = np.rint(w / np.where(scale > 0, scale, 1)).clip(-127, 127).astype(np.int16) + 128
        u = _pad(q.astype(np.uint8), kp, np_ * PANEL, 128)
        data = u.reshape(kp // 4, 4, np_, PANEL).transpose(2, 0, 3, 1)
        scales = _pad(scale[None, :].astype(np.float32), 1, np_ * PANEL)[0]
        return PackedWeight(fmt, k, n, paddle.to_tensor(np.ascontiguousarray(data)), paddle.to_tensor(scales))
    kp = -(-k // INT4_GROUP) * INT4_GROUP
    wp = _pad(w, kp, np_ * PANEL).reshape(kp // INT4_GROUP, INT4_GROUP, np_ * PANEL)
    # llama.cpp's Q4_0 choice: the group's value of largest magnitude maps exactly to -8, so all 16
    # levels are used (~12% less error than max|W| / 7 on Gaussian weights). The scale may be negative.
    extreme = np.take_along_axis(wp, np.abs(wp).argmax(axis=1)[:, None, :], axis=1)[:, 0, :]
    scale = extreme / np.float32(-8)  # [groups, Np * 16]
    q = np.rint(wp / np.where(scale != 0, scale, 1)[:, None, :]).clip(-8, 7).astype(np.int16) + 8
    u = q.astype(np.uint8).reshape(kp // 8, 2, 4, np_, PANEL).transpose(3, 0, 4, 2, 1)  # [Np, Kp/8, 16, 4, 2]
    data = u[..., 0] | (u[..., 1] << 4)
    scales = scale.astype(np.float32).reshape(kp // INT4_GROUP, np_, PANEL).transpose(1, 0, 2)
    return PackedWeight(fmt, k, n, paddle.to_tensor(np.ascontiguousarray(data)),
                        paddle.to_tensor(np.ascontiguousarray(scales)))


def unpack_weight(pw: PackedWeight, padded: bool = False) -> paddle.Tensor:
    """Pure Paddle: the dequantized float32 matrix [K, N] (with `padded`, [k_padded, N])."""
    np_ = pw.data.shape[0]
    if pw.fmt in ("fp32", "bf16"):
        w = pw.data.astype("float32").transpose([1, 0, 2]).reshape([pw.k, np_ * PANEL])
    elif pw.fmt == "int8":
        q = pw.data.astype("int32") - 128  # [Np, Kp/4, 16, 4]
        q = q.transpose([1, 3, 0, 2]).reshape([pw.k_padded, np_ * PANEL]).astype("float32")
        w = q * pw.scales.reshape([1, np_ * PANEL])
    else:
        low = paddle.bitwise_and(pw.data, paddle.full([1], 15, dtype="uint8"))
        high = paddle.bitwise_right_shift(pw.data, paddle.full([1], 4, dtype="uint8"))
        q = paddle.stack([low, high], axis=-1).astype("int32") - 8  # [Np, Kp/8, 16, 4, 2]
        q = q.transpose([1, 4, 3, 0, 2]).reshape([pw.k_padded, np_ * PANEL]).astype("float32")
        scales = pw.scales.transpose([1, 0, 2]).reshape([pw.k_padded // INT4_GROUP, np_ * PANEL])
        w = q * paddle.repeat_interleave(scales, INT4_GROUP, axis=0)
    w = w[:, : pw.n]
    return w if padded else w[: pw.k]


def quantize_activations_reference(x: paddle.Tensor, k_padded: int) -> paddle.Tensor:
    """Pure Paddle: x [T, K] rounded the way the int8/int4 kernels see it (per row, per 32-k block,
    q = round-half-even(x * 127 / max|x|), value q * max|x| / 127), zero-padded to [T, k_padded]."""
    t, k = x.shape
    if k_padded > k:
        x = paddle.concat([x, paddle.zeros([t, k_padded - k], dtype=x.dtype)], axis=1)
    blocks = x.reshape([t, k_padded // ACT_BLOCK, ACT_BLOCK])
    amax = paddle.max(paddle.abs(blocks), axis=-1, keepdim=True)
    inv = paddle.where(amax > 0, 127.0 / paddle.where(amax > 0, amax, paddle.ones_like(amax)),
                       paddle.zeros_like(amax))
    q = paddle.round(blocks * inv)
    return (q * (amax / 127.0)).reshape([t, k_padded])
