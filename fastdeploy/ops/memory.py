"""Keep freed activation memory in the process heap instead of returning it to the OS.

Paddle's CPU allocator takes every tensor from malloc. glibc serves blocks above its mmap threshold
(128 KB, adapting up to 32 MB) with fresh mappings and unmaps them on free, so each new large
activation pays a page fault per 4 KB: measured here, a [2048, 3072] float32 op output costs ~6,100
faults, ~10 ms of a 16 ms op, and `paddle.empty` + fill of it drops from 12 ms to 1.2 ms with the
thresholds raised. Opt-in and process-wide, for the engine to call once at start-up.
"""
from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit


def keep_freed_memory(max_block_bytes: int = _MAX_MMAP_THRESHOLD, trim_bytes: int = 1 << 30) -> bool:
    """Serve blocks up to `max_block_bytes` (<= 32 MB) from the heap, and only give freed heap memory
    back to the OS when more than `trim_bytes` is free at its top. Returns False when the C library
    has no mallopt (not glibc), True when both settings were applied."""
    if not 0 < max_block_bytes <= _MAX_MMAP_THRESHOLD:
        raise ValueError(f"max_block_bytes must be in (0, {_MAX_MMAP_THRESHOLD}], got {max_block_bytes}")
    if trim_bytes <= 0:
        raise ValueError(f"trim_bytes must be > 0, got {trim_bytes}")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("mallopt is not available: freed memory stays managed by the C library's defaults")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    trim_bytes = min(trim_bytes, 2**31 - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, max_block_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))
