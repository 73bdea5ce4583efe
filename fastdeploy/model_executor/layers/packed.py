"""Weights that only ever exist packed (`ops.PackedWeight`), never as a float32 parameter.

A `PackedParameter` is a destination: this rank's [k, n] matrix (or E stacked experts' matrices), its
format chosen once the checkpoint's dtypes are known (`Precision.format_for`), allocated without being touched
(`allocate`), then filled column range by column range straight from the memory-mapped checkpoint
(`fill`). A `WeightSlot` is what one checkpoint tensor fills: the unsharded shape it must have and the
loader that slices this rank's share into its destination. load.py finds slots by name, like
parameters, so the checkpoint naming rules (prefixes, fused/unfused parts, orientation) stay in one place.

Formats (`Precision.format_for`): without quantization a weight keeps its checkpoint precision under
dtype "auto" (bf16 when every tensor that fills it is stored bf16, which packs exactly; fp32 otherwise),
or is held as dtype "bfloat16" / "float32" says. bf16 weights are multiplied with bf16-rounded
activations, fp32 ones in float32 (fastdeploy/ops/linear.py). `quantization="wint8"` packs linear
layers as int8 per output channel, `"wint4"` as int4 per 128 inputs (`moe_quantization`, mix_quant's
moe_quant_type, overrides it for the routed experts' stacked weights); the embedding / LM head table is
int8 under both (its logits decide every token, and llama.cpp keeps it above 4 bits for the same
reason) unless `lm_head_fp32`; MoE routers are always float32, so routing is computed in float32.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from paddle import nn

from fastdeploy import ops
from fastdeploy.ops.quant import PackedWeight, packed_shapes

QUANTIZED_FORMATS = {"wint8": "int8", "wint4": "int4"}
ROLES = ("linear", "router", "table")  # table: the embedding / LM head matrix


@dataclass(frozen=True, slots=True)
class Precision:
    """How the packed weights are held: `quantization` (None, "wint8", "wint4") for the linear layers,
    `moe_quantization` for the routed experts when it differs (None: as `quantization`), `dtype` for the
    unquantized ones, the embedding / LM head table in float32 when `lm_head_fp32`."""

    quantization: str | None = None
    dtype: str = "auto"
    lm_head_fp32: bool = False
    moe_quantization: str | None = None

    def format_for(self, weight: PackedParameter) -> str:
        if weight.role == "router" or (weight.role == "table" and self.lm_head_fp32):
            return "fp32"
        if weight.experts and self.moe_quantization is not None:
            return QUANTIZED_FORMATS[self.moe_quantization]
        if self.quantization is not None:
            return "int8" if weight.role == "table" else QUANTIZED_FORMATS[self.quantization]
        if self.dtype == "auto":
            return "bf16" if weight.stored_kinds == {"bf16"} else "fp32"
        return "bf16" if self.dtype == "bfloat16" else "fp32"

    def describe(self) -> str:
        parts = [f"quantization={self.quantization!r}" if self.quantization else "no quantization"]
        if self.moe_quantization is not None:
            parts.append(f"experts {self.moe_quantization!r}")
        if self.dtype != "auto":
            parts.append(f"dtype={self.dtype!r}")
        if self.lm_head_fp32:
            parts.append("lm_head_fp32")
        return ", ".join(parts)


class PackedParameter:
    """This rank's weight [k, n] (x @ W), or `experts` stacked ones, held only in packed form."""

    __slots__ = ("k", "n", "experts", "role", "stored_kinds", "value")

    def __init__(self, k: int, n: int, experts: int = 0, role: str = "linear") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.k, self.n, self.experts, self.role = k, n, experts, role
        self.stored_kinds: set[str] = set()  # how the checkpoint stores what fills it ("bf16", "f16bits", "float")
        self.value: PackedWeight | None = None

    def nbytes_for(self, fmt: str) -> int:
        """Bytes the packed weight will take in `fmt` (computed, nothing allocated)."""
        data, dtype, scales = packed_shapes(fmt, self.k, self.n)
        size = int(np.prod(data)) * {"float32": 4, "bfloat16": 2}.get(dtype, 1)
        size += int(np.prod(scales)) * 4 if scales is not None else 0
        return size * max(self.experts, 1)

    def allocate(self, fmt: str) -> None:
        self.value = ops.empty_packed(fmt, self.k, self.n, self.experts)

    def fill(self, source: Any, col0: int = 0, expert: int | None = None) -> None:
        """Pack `source` ([rows of k, columns] lazy checkpoint view, or an array) into columns
        [col0, col0 + its width) (of one expert)."""
        array = source.packable() if hasattr(source, "packable") else np.asarray(source)
        ops.pack_into(self.value, array, col0, expert)

    def dense(self, expert: int | None = None) -> np.ndarray:
        """The float32 [k, n] matrix it holds (unpacked), for inspection."""
        value = self.value if expert is None else self.value.expert(expert)
        return ops.unpack_weight(value).numpy()


Loader = Callable[["WeightSlot", Any, "int | str | None"], None]


class WeightSlot:
    """One checkpoint tensor's place in a `PackedParameter`. `global_shape` is the unsharded shape the
    tensor must have as the layer lays it out ([in, out] for linear weights: `linear_in_out` tells
    load.py to transpose HF's [out, in]); `part_sizes` names the parts of a fused weight."""

    __slots__ = ("target", "global_shape", "weight_loader", "linear_in_out", "part_sizes", "expert", "dense")

    def __init__(self, target: PackedParameter, global_shape: list[int], loader: Loader, *,
                 linear_in_out: bool = True, part_sizes: dict[str, int] | None = None, expert: int | None = None,
                 dense: Callable[[], np.ndarray] | None = None) -> None:
        self.target = target
        self.global_shape = list(global_shape)
        self.weight_loader = loader  # called as weight_loader(slot, lazy_array, shard_id), like a parameter's
        self.linear_in_out = linear_in_out
        self.part_sizes = part_sizes
        self.expert = expert
        self.dense = dense or (lambda: target.dense(expert))  # what was loaded, as the layer lays it out

    @property
    def shape(self) -> list[int]:
        return self.global_shape


def add_slot(layer: nn.Layer, name: str, slot: WeightSlot) -> None:
    """Register `slot` under `name` (relative to the layer, e.g. "weight" or "3.down_proj.weight")."""
    if "weight_slots" not in layer.__dict__:
        layer.__dict__["weight_slots"] = {}
    layer.__dict__["weight_slots"][name] = slot


def named_slots(model: nn.Layer) -> Iterator[tuple[str, WeightSlot]]:
    for prefix, layer in model.named_sublayers(include_self=True):
        for name, slot in layer.__dict__.get("weight_slots", {}).items():
            yield (f"{prefix}.{name}" if prefix else name), slot


def packed_parameters(model: nn.Layer) -> list[PackedParameter]:
    """Every distinct destination, including the ones no slot fills (e.g. a tied LM head's is the embedding's)."""
    seen: dict[int, PackedParameter] = {}
    for _, layer in model.named_sublayers(include_self=True):
        for value in layer.__dict__.values():
            if isinstance(value, PackedParameter):
                seen.setdefault(id(value), value)
    return list(seen.values())
