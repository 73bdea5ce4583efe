"""How much memory the weights will take, decided before any of it is allocated, and what the host has.

The packed size of every weight is known from the checkpoint's header and the chosen format, so a model
that cannot fit is refused up front with what it needs, what is available, and which `quantization`
would fit, instead of being killed by the OS halfway through loading.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace

from fastdeploy.model_executor.layers.packed import PackedParameter, Precision

logger = logging.getLogger(__name__)

GIB = 1 << 30
RUNTIME_BYTES = 1 << 30  # Paddle's runtime, activations of a step, the tokenizer: kept free beside the weights
QUANTIZATION_CHOICES = (None, "wint8", "wint4")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory_bytes() -> int:
    """What the host can still give (MemAvailable: free memory plus reclaimable page cache)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return host_memory_bytes()


def resident_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default)."""
    with open(f"/proc/{pid or 'self'}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def weights_bytes(weights: Sequence[PackedParameter], precision: Precision) -> int:
    return sum(w.nbytes_for(precision.format_for(w)) for w in weights)


def _describe(precision: Precision, weights: Sequence[PackedParameter]) -> str:
    if precision.quantization is not None or precision.dtype != "auto":
        return precision.describe()
    formats = sorted({precision.format_for(w) for w in weights if w.role != "router"})
    return f"{precision.describe()} ({'/'.join(formats)} as stored)"


def check_fits(weights: Sequence[PackedParameter], precision: Precision, tp_size: int = 1,
               available_bytes: int | None = None) -> int:
    """Bytes the packed weights of all `tp_size` ranks will take (this rank's times the rank count);
    raises ValueError when they and a runtime reserve exceed `available_bytes` (default: the host's
    available memory), naming the quantizations that would fit."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    options = {q: replace(precision, quantization=q, moe_quantization=None) for q in QUANTIZATION_CHOICES}
    need = {q: weights_bytes(weights, p) * tp_size for q, p in options.items()}
    mine = weights_bytes(weights, precision) * tp_size
    if mine + RUNTIME_BYTES <= available:
        logger.info("packed weights will take %.2f GiB (%s); %.1f GiB available", mine / GIB,
                    _describe(precision, weights), available / GIB)
        return mine
    fits = [f"{_describe(options[q], weights)} needs ~{need[q] / GIB:.1f} GiB" for q in QUANTIZATION_CHOICES
            if options[q] != precision and need[q] + RUNTIME_BYTES <= available and need[q] < mine]
    advice = "; ".join(fits) if fits else "no supported quantization fits either"
    raise ValueError(f"the model's weights need ~{mine / GIB:.1f} GiB with "
                     f"{_describe(precision, weights)}, plus ~{RUNTIME_BYTES / GIB:.0f} GiB to run, and "
                     f"{available / GIB:.1f} GiB is available; {advice}")
