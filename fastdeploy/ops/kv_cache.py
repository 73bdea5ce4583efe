"""The KV cache's formats: what one layer's cache tensor is for each `kv_cache_dtype`, and the block_wise_fp8
rows as the reference writes and reads them.

A layer's cache is [2, num_blocks, kv heads, block_size, row]: keys then values, one row per (position,
kv head). float32 and bfloat16 rows are head_dim elements. block_wise_fp8 (FastDeploy's
`kv_cache_quant_type`) rows are uint8: head_dim float8 e4m3fn codes, then the row's float32 scale (its
largest |value| / 448, little-endian): each row is scaled to a largest |value| of 448 (e4m3fn's largest
finite) and rounded to nearest even, so a row of 128 values takes 132 bytes instead of 256 in bf16.
"""
from __future__ import annotations

import numpy as np
import paddle

FP8_MAX = 448.0
FP8_SCALE_BYTES = 4
_CACHE_KINDS = {paddle.float32: 0, paddle.bfloat16: 1, paddle.uint8: 2}  # fd::CacheKind (custom_ops/fd_kernels.h)
_TENSORS = {"float32": ("float32", 4), "bfloat16": ("bfloat16", 2), "block_wise_fp8": ("uint8", 1)}  # dtype, bytes


def row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of one cache row."""
    return head_dim + FP8_SCALE_BYTES if kv_cache_dtype == "block_wise_fp8" else head_dim


def row_bytes(head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one cache row (one position of one kv head's keys, or its values)."""
    return row_width(head_dim, kv_cache_dtype) * _TENSORS[kv_cache_dtype][1]


def allocate_cache(num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                   kv_cache_dtype: str) -> paddle.Tensor:
    """One layer's cache, left uninitialised: attention reads only rows written earlier, and untouched
    pages cost no RAM."""
    shape = [2, num_blocks, kv_heads, block_size, row_width(head_dim, kv_cache_dtype)]
    return paddle.empty(shape, dtype=_TENSORS[kv_cache_dtype][0])


def cache_kind(cache: paddle.Tensor) -> int:
    """The kernels' code for the cache's rows (fd::CacheKind): float32, bfloat16, or uint8 block_wise_fp8."""
    return _CACHE_KINDS[cache.dtype]


def quantize_fp8_rows(x: np.ndarray) -> np.ndarray:
    """float32 [n, d] -> uint8 [n, d + 4] block_wise_fp8 rows: x * (448 / max|x|) in float32, cast to
    float8_e4m3fn by Paddle (nearest even, saturating), then the float32 scale max|x| / 448."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(FP8_MAX) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = paddle.to_tensor(x * inv).astype("float8_e4m3fn").view("uint8").numpy()
    scale = (amax / np.float32(FP8_MAX)).astype("<f4")
    return np.concatenate([codes, scale.view(np.uint8)], axis=1)


def dequantize_fp8_rows(rows: np.ndarray) -> np.ndarray:
    """uint8 [n, d + 4] block_wise_fp8 rows -> float32 [n, d]: each code's value (Paddle's float8_e4m3fn
    cast) times its row's scale."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    d = rows.shape[1] - FP8_SCALE_BYTES
    values = paddle.to_tensor(np.ascontiguousarray(rows[:, :d])).view("float8_e4m3fn").astype("float32").numpy()
    scale = np.ascontiguousarray(rows[:, d:]).view("<f4")
    return values * scale
