"""Compiled packing of checkpoint tensors straight into their packed destination.

`pack_into(dst, src, col0)` reads src [K, ncols] (raw bfloat16 bits as uint16, float16 or float32) in
place through its pointer and strides - a transposed or column-sliced view of a memory-mapped
safetensors file works without a copy - and writes destination columns [col0, col0 + ncols) of `dst`
(from `empty_packed`), all Kp rows and their scales, in parallel over 16-column panels. The bits equal
`pack_into_reference` / `pack_weight_reference`. The op is an `extern "C"` function of the custom-op
library (custom_ops/dispatch.cc, kernels in kern_pack.inc) called through ctypes, which releases the
GIL for the call, so loader threads can pack while others read.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import paddle

from fastdeploy.ops import build
from fastdeploy.ops.quant import (FORMATS, SRC_DTYPES, PackedWeight, as_matrix, check_fmt, check_pack_args,
                                   empty_packed, pack_into_reference)

_c_int64 = ctypes.c_int64
_functions: dict[str, Callable[..., int]] = {}  # library path -> its fd_pack_columns


def _pack_function(lib: build.OpsLibrary) -> Callable[..., int]:
    key = str(lib.path)
    if key not in _functions:
        fn = ctypes.CDLL(key).fd_pack_columns  # the library Paddle already loaded: same handle
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, _c_int64, _c_int64, _c_int64, _c_int64, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_void_p, _c_int64, _c_int64]
        fn.restype = ctypes.c_int
        _functions[key] = fn
    return _functions[key]


def pack_into(dst: PackedWeight, src: np.ndarray, col0: int = 0, expert: int | None = None, *,
              use_compiled: bool = True) -> None:
    """Pack src [K, ncols] (any non-negative strides; uint16 = bfloat16 bits, float16 or float32) into
    columns [col0, col0 + ncols) of dst, of expert `expert` when dst is stacked. Writes every Kp row
    of those columns (padding rows q = 0) and their scales; other columns are left as they are, so the
    parts of a fused weight (q|k|v, gate|up) are packed by one call each."""
    target = check_pack_args(dst, src, col0, expert)
    k, ncols = src.shape
    if ncols == 0:
        return
    lib = build.compiled(use_compiled)
    if lib is None:
        pack_into_reference(dst, src, col0, expert)
        return
    stride_k, stride_n = (s // src.itemsize for s in src.strides)
    # A length-1 axis may carry any stride; give it one the kernel's contiguous-row paths recognise.
    stride_k = 1 if k == 1 else stride_k
    stride_n = 1 if ncols == 1 else stride_n
    scales = target.scales.data_ptr() if target.fmt in ("int8", "int4") else None
    rc = _pack_function(lib)(src.ctypes.data, SRC_DTYPES[src.dtype], k, ncols, stride_k, stride_n,
                             FORMATS[target.fmt], target.data.data_ptr(), scales, target.n, int(col0))
    if rc != 0:  # arguments are checked above, so this is an internal inconsistency
        raise ValueError(f"fd_pack_columns rejected its arguments (code {rc})")


def pack_weight(w: np.ndarray | paddle.Tensor, fmt: str) -> PackedWeight:
    """Quantize/pack W [K, N] (float, or for "bf16" raw bfloat16 bits as uint16) into `fmt`: the
    compiled op when available (same bits as `pack_weight_reference`)."""
    check_fmt(fmt)
    w = as_matrix(w)
    if w.dtype == np.uint16 and fmt != "bf16":
        raise ValueError("uint16 (raw bfloat16) input is only accepted for fmt='bf16'")
    if w.dtype not in (np.uint16, np.float16, np.float32):
        w = w.astype(np.float32)
    dst = empty_packed(fmt, w.shape[0], w.shape[1])
    pack_into(dst, w)
    return dst
