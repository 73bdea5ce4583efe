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
`pack_weight_reference` / `pack_into_reference` are the numpy definitions; the compiled op behind
`pack_weight` / `pack_into` (fastdeploy/ops/pack.py) gives the same bits. Stacked (MoE) weights add a
leading expert axis to data and (int8/int4) scales. `unpack_weight` inverts packing in Paddle.
"""
from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass, field

import numpy as np
import paddle

PANEL = 16
ACT_BLOCK = 32
INT4_GROUP = 128
FORMATS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
_DATA_NDIM = {"fp32": 3, "bf16": 3, "int8": 4, "int4": 4}  # of one (unstacked) weight
# Source dtypes of pack_into, with their codes in the compiled op (fd::PackSrcDtype).
SRC_DTYPES = {np.dtype(np.uint16): 0, np.dtype(np.float16): 1, np.dtype(np.float32): 2}


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
    def num_experts(self) -> int:
        """E of a stacked [E, ...] weight (MoE experts), 0 for a single weight."""
        return int(self.data.shape[0]) if len(self.data.shape) == _DATA_NDIM[self.fmt] + 1 else 0

    def expert(self, e: int) -> PackedWeight:
        """Expert e of a stacked weight, sharing its memory."""
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert must be in [0, {self.num_experts}), got {e!r}")
        scales = self.scales[e] if self.fmt in ("int8", "int4") else self.scales
        return PackedWeight(self.fmt, self.k, self.n, self.data[e], scales)

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass streams: packed data plus scales."""
        size = int(np.prod(self.data.shape)) * (4 if self.fmt == "fp32" else 2 if self.fmt == "bf16" else 1)
        return size + (int(np.prod(self.scales.shape)) * 4 if self.fmt in ("int8", "int4") else 0)


def as_matrix(w: np.ndarray | paddle.Tensor) -> np.ndarray:
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


def _pack_numpy(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The reference packing of a whole [K, N] matrix: (data, scales or None), as numpy arrays."""
    k, n = w.shape
    np_ = -(-n // PANEL)
    if fmt in ("fp32", "bf16"):
        if fmt == "bf16":
            bits = w if w.dtype == np.uint16 else _to_bf16_bits(w)
            panels = _pad(bits, k, np_ * PANEL).reshape(k, np_, PANEL).transpose(1, 0, 2)
        else:
            panels = _pad(w.astype(np.float32), k, np_ * PANEL).reshape(k, np_, PANEL).transpose(1, 0, 2)
        return np.ascontiguousarray(panels), None
    w = w.astype(np.float32)
    if fmt == "int8":
        kp = -(-k // ACT_BLOCK) * ACT_BLOCK
        scale = np.abs(w).max(axis=0) / np.float32(127)
        q = np.rint(w / np.where(scale > 0, scale, 1)).clip(-127, 127).astype(np.int16) + 128
        u = _pad(q.astype(np.uint8), kp, np_ * PANEL, 128)
        data = u.reshape(kp // 4, 4, np_, PANEL).transpose(2, 0, 3, 1)
        return np.ascontiguousarray(data), _pad(scale[None, :].astype(np.float32), 1, np_ * PANEL)[0]
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
    return np.ascontiguousarray(data), np.ascontiguousarray(scales)


def check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")


def pack_weight_reference(w: np.ndarray | paddle.Tensor, fmt: str) -> PackedWeight:
    """numpy: quantize/pack W [K, N] (float, or for "bf16" raw bfloat16 bits as uint16) into `fmt`."""
    check_fmt(fmt)
    w = as_matrix(w)
    if w.dtype == np.uint16 and fmt != "bf16":
        raise ValueError("uint16 (raw bfloat16) input is only accepted for fmt='bf16'")
    data, scales = _pack_numpy(w, fmt)
    return PackedWeight(fmt, w.shape[0], w.shape[1], paddle.to_tensor(data),  # uint16 -> paddle bfloat16
                        paddle.zeros([1], dtype="float32") if scales is None else paddle.to_tensor(scales))


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


def packed_shapes(fmt: str, k: int, n: int) -> tuple[list[int], str, list[int] | None]:
    """(data shape, data dtype, scales shape or None) of one packed [k, n] weight."""
    check_fmt(fmt)
    np_ = -(-n // PANEL)
    if fmt in ("fp32", "bf16"):
        return [np_, k, PANEL], "float32" if fmt == "fp32" else "bfloat16", None
    if fmt == "int8":
        kp = -(-k // ACT_BLOCK) * ACT_BLOCK
        return [np_, kp // 4, PANEL, 4], "uint8", [np_ * PANEL]
    kp = -(-k // INT4_GROUP) * INT4_GROUP
    return [np_, kp // 8, PANEL, 4], "uint8", [np_, kp // INT4_GROUP, PANEL]


_NUMPY_DTYPES = {paddle.float32: np.float32, paddle.bfloat16: np.uint16, paddle.uint8: np.uint8}


def numpy_view(t: paddle.Tensor) -> np.ndarray:
    """A writable numpy array over a contiguous CPU tensor's memory (np.from_dlpack gives read-only
    ones). Creating it touches no page. The tensor must outlive the array."""
    size = int(np.prod(t.shape)) * t.element_size()
    buf = (ctypes.c_uint8 * size).from_address(t.data_ptr())
    return np.frombuffer(buf, dtype=_NUMPY_DTYPES[t.dtype]).reshape(t.shape)


_HUGE_PAGE = 2 << 20
_libc = ctypes.CDLL(None)


def advise_huge_pages(t: paddle.Tensor) -> None:
    """Ask the OS to back the whole 2 MiB pages inside a CPU tensor's untouched memory with transparent huge
    pages (where the kernel offers them on request). Weights stream through the kernels: with 4 KiB pages
    every 4 KiB of a stream is a TLB miss (kernel_ab.py moe, Zen 4: 0.86-0.97x the time with huge pages)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + int(np.prod(t.shape)) * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if advice is not None and end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)  # a refusal changes nothing


def empty_packed(fmt: str, k: int, n: int, experts: int = 0) -> PackedWeight:
    """Uninitialised destination for pack_into: [k, n] packed as `fmt`, or `experts` of them stacked
    [E, ...] (experts > 0). Only the padding columns n .. Np*16 - 1 are written (with what packing
    zeros gives: q = 0, scale 0 - int4's is -0.0 = 0 / -8), so the bulk stays unallocated by the OS
    until packed, and is fully defined once every column 0 .. n-1 has been packed."""
    check_fmt(fmt)
    for name, value, low in (("k", k, 1), ("n", n, 1), ("experts", experts, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    k, n, experts = int(k), int(n), int(experts)
    shape, dtype, scales_shape = packed_shapes(fmt, k, n)
    lead = [experts] if experts else []
    data = paddle.empty(lead + shape, dtype=dtype)
    advise_huge_pages(data)
    scales = paddle.empty(lead + scales_shape, dtype="float32") if scales_shape else paddle.zeros([1], "float32")
    jn = n - (shape[0] - 1) * PANEL  # valid columns of the last panel
    if jn < PANEL:
        d = numpy_view(data)
        if fmt in ("fp32", "bf16"):
            d[..., -1, :, jn:] = 0
        else:
            d[..., -1, :, jn:, :] = 128 if fmt == "int8" else 0x88
        if fmt == "int8":
            numpy_view(scales)[..., n:] = 0.0
        elif fmt == "int4":
            numpy_view(scales)[..., -1, :, jn:] = -0.0
    return PackedWeight(fmt, k, n, data, scales)


def check_pack_args(dst: PackedWeight, src: np.ndarray, col0: int, expert: int | None) -> PackedWeight:
    """Validate pack_into's arguments; returns the (expert's) destination weight."""
    if not isinstance(dst, PackedWeight):
        raise TypeError(f"dst must be a PackedWeight (see empty_packed), got {type(dst).__name__}")
    if not isinstance(src, np.ndarray):
        raise TypeError(f"src must be a numpy array, got {type(src).__name__}")
    if src.dtype not in SRC_DTYPES:
        raise TypeError(f"src dtype must be uint16 (bfloat16 bits), float16 or float32, got {src.dtype} "
                        "(convert other dtypes first)")
    if src.ndim != 2:
        raise ValueError(f"src must be 2-D [K, ncols], got shape {src.shape}")
    if src.shape[0] != dst.k:
        raise ValueError(f"src has {src.shape[0]} rows but dst has k = {dst.k} (in_features)")
    if any(s < 0 or s % src.itemsize for s in src.strides):
        raise ValueError(f"src strides must be non-negative multiples of its item size, got {src.strides}")
    if isinstance(col0, bool) or not isinstance(col0, (int, np.integer)):
        raise TypeError(f"col0 must be an int, got {type(col0).__name__}")
    if col0 < 0 or col0 + src.shape[1] > dst.n:
        raise ValueError(f"col0 = {col0} with {src.shape[1]} columns exceeds dst's n = {dst.n} columns")
    experts = dst.num_experts
    if experts:
        if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)) or not 0 <= expert < experts:
            raise ValueError(f"expert must be an int in [0, {experts}) for a stacked dst, got {expert!r}")
        return dst.expert(int(expert))
    if expert is not None:
        raise ValueError(f"expert must be None for a dst that is not stacked, got {expert!r}")
    return dst


def pack_into_reference(dst: PackedWeight, src: np.ndarray, col0: int = 0, expert: int | None = None) -> None:
    """numpy: pack src [K, ncols] into columns [col0, col0 + ncols) of dst (see fastdeploy.ops.pack_into).
    Converts the given columns to float32 (once, not the whole checkpoint tensor)."""
    target = check_pack_args(dst, src, col0, expert)
    k, ncols = src.shape
    if ncols == 0:
        return
    p0, p1 = col0 // PANEL, -(-(col0 + ncols) // PANEL)
    off = col0 - p0 * PANEL
    # Whole panels around the columns: quantization is per column, so the zero neighbours do not matter.
    if target.fmt == "bf16" and src.dtype == np.uint16:
        wide = np.zeros((k, (p1 - p0) * PANEL), np.uint16)
        wide[:, off:off + ncols] = src
    else:
        wide = np.zeros((k, (p1 - p0) * PANEL), np.float32)
        wide[:, off:off + ncols] = (src.astype(np.uint32) << 16).view(np.float32) if src.dtype == np.uint16 else src
    data, scales = _pack_numpy(wide, target.fmt)
    d = numpy_view(target.data)
    s = numpy_view(target.scales) if scales is not None else None
    for i, p in enumerate(range(p0, p1)):
        lo, hi = max(0, col0 - p * PANEL), min(PANEL, col0 + ncols - p * PANEL)
        d[p, :, lo:hi] = data[i, :, lo:hi]
        if target.fmt == "int4":
            s[p, :, lo:hi] = scales[i, :, lo:hi]
    if target.fmt == "int8":
        s[col0:col0 + ncols] = scales[off:off + ncols]
