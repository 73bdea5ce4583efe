"""Linear layers that take their weights from a checkpoint, whole or as a tensor-parallel shard.

A layer's weight W [in, out] (y = x @ W) is a `PackedParameter`: it never exists in float32. Its
`WeightSlot` loader receives the checkpoint tensor already in [in, out] orientation (load.py
transposes HF-layout tensors) and still lazy (load.LazyArray, a view of the memory-mapped file), and
packs only the slice this rank keeps, straight into the format chosen for it (fp32, bf16, int8 or
int4; see packed.py). `slot.global_shape` is the unsharded shape the checkpoint must have. Biases are
small float32 parameters with a `weight_loader` of their own.

Tensor parallel (Megatron style): `MergedLinear` is column-parallel (each rank keeps a slice of
every part's outputs: whole heads of q/k/v, an equal share of gate and up), `RowParallelLinear`
keeps a slice of the inputs and sums the ranks' partial products. A column-parallel layer followed
by a row-parallel one needs a single all-reduce.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle

from paddle import nn

from fastdeploy import ops
from fastdeploy.distributed.parallel_state import TPGroup, current_tp, kv_head_start, kv_heads_per_rank
from fastdeploy.model_executor.layers.packed import PackedParameter, WeightSlot, add_slot


def _zeros_param(layer: nn.Layer, shape: list[int], global_shape: list[int] | None = None) -> paddle.Tensor:
    # Zero init is cheap; real values always come from the checkpoint.
    param = layer.create_parameter(shape, dtype="float32", default_initializer=nn.initializer.Constant(0.0))
    param.stop_gradient = True
    param.global_shape = list(global_shape if global_shape is not None else shape)
    return param


def _no_shard(shard_id: int | str | None) -> None:
    if shard_id is not None:
        raise ValueError(f"this weight has no parts (got shard {shard_id!r})")


def _check_shape(param: Any, array: Any, what: str) -> None:
    expected = getattr(param, "global_shape", None) or list(param.shape)
    if tuple(array.shape) != tuple(expected):
        raise ValueError(f"{what}: got shape {list(array.shape)} (as the parameter is laid out), "
                         f"the model expects {list(expected)}")


def default_weight_loader(param: paddle.Tensor, array: Any, shard_id: int | str | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {list(param.shape)} has no shards (got shard {shard_id!r})")
    _check_shape(param, array, "weight")
    param.set_value(np.asarray(array, dtype=np.float32))


def even_slice(size: int, tp: TPGroup) -> tuple[int, int]:
    """This rank's equal share [lo, hi) of `size` (which the group size divides)."""
    tp.check_divides(size, "the layer width")
    per = size // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def qkv_slices(num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup) -> list[tuple[int, int]]:
    """Output ranges of q, k, v this rank keeps: whole query heads, and its KV heads (replicated
    when there are fewer KV heads than ranks)."""
    q_lo = tp.rank * (num_heads // tp.size) * head_dim
    kv_lo = kv_head_start(num_kv_heads, tp.size, tp.rank) * head_dim
    kv_hi = kv_lo + kv_heads_per_rank(num_kv_heads, tp.size) * head_dim
    return [(q_lo, q_lo + num_heads // tp.size * head_dim), (kv_lo, kv_hi), (kv_lo, kv_hi)]


class PackedMatmul:
    """Mixin of the layers computing x @ W, W held only packed in `self.weight` (a PackedParameter)
    and multiplied by the compiled weight-only GEMM."""

    weight: PackedParameter

    @property
    def packed(self) -> ops.PackedWeight | None:
        return self.weight.value

    def matmul(self, x: paddle.Tensor) -> paddle.Tensor:
        return ops.weight_only_linear(x, self.weight.value)


def _new_weight(layer: nn.Layer, k: int, n: int, global_shape: list[int], loader: Any, role: str = "linear",
                part_sizes: dict[str, int] | None = None) -> PackedParameter:
    weight = PackedParameter(k, n, role=role)
    add_slot(layer, "weight", WeightSlot(weight, global_shape, loader, part_sizes=part_sizes))
    return weight


class Linear(PackedMatmul, nn.Layer):
    """y = x @ W (+ b); W is [in_features, out_features]. Replicated on every tensor-parallel rank.
    role="router" keeps it unquantized (an MoE gate: routing decides which experts run)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, role: str = "linear") -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _new_weight(self, in_features, out_features, [in_features, out_features],
                                  self.weight_loader, role)
        self.bias = _zeros_param(self, [out_features]) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, slot: WeightSlot, array: Any, shard_id: int | str | None = None) -> None:
        _no_shard(shard_id)
        _check_shape(slot, array, "weight")
        slot.target.fill(array)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(PackedMatmul, nn.Layer):
    """y = sum over ranks of x_r @ W_r (+ b): each rank keeps rows [lo, hi) of W [in, out] and gets
    the matching slice of the input features (the output of a column-parallel layer)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else current_tp()
        self.in_features = in_features
        self.out_features = out_features
        self.lo, self.hi = even_slice(in_features, self.tp)
        self.weight = _new_weight(self, self.hi - self.lo, out_features, [in_features, out_features],
                                  self.weight_loader)
        self.bias = _zeros_param(self, [out_features]) if bias else None  # whole, added once
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, slot: WeightSlot, array: Any, shard_id: int | str | None = None) -> None:
        _no_shard(shard_id)
        _check_shape(slot, array, "weight")
        slot.target.fill(array[self.lo:self.hi])

    def forward(self, x: paddle.Tensor, reduce: bool = True) -> paddle.Tensor:
        """reduce=False returns this rank's partial sum (bias on rank 0 only), for a caller that adds
        several partial sums before one all-reduce."""
        y = self.matmul(x)
        if reduce:
            y = self.tp.all_reduce(y)
            return y if self.bias is None else y + self.bias
        return y if self.bias is None or self.tp.rank != 0 else y + self.bias


class Parts:
    """The column layout of a fused weight (q|k|v, gate|up): `output_sizes` of the whole layer, the range
    `slices[i]` of part i this rank keeps, and where it lands in the rank's columns. Checkpoints give
    each part separately (shard_id = index or name) or already fused (shard_id None: split here)."""

    def __init__(self, output_sizes: Sequence[int], shard_names: Sequence[str] | None,
                 slices: Sequence[tuple[int, int]]) -> None:
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names) if shard_names is not None else []
        if self.shard_names and len(self.shard_names) != len(self.output_sizes):
            raise ValueError(f"shard_names {self.shard_names} must name each of the {len(self.output_sizes)} parts")
        self.slices = list(slices)
        self.local_sizes = [hi - lo for lo, hi in self.slices]
        self.offsets = np.concatenate([[0], np.cumsum(self.output_sizes)]).astype(int).tolist()
        self.local_offsets = np.concatenate([[0], np.cumsum(self.local_sizes)]).astype(int).tolist()

    @property
    def named_sizes(self) -> dict[str, int] | None:
        return dict(zip(self.shard_names, self.output_sizes)) if self.shard_names else None

    def index(self, shard_id: int | str) -> int:
        if isinstance(shard_id, str):
            if shard_id not in self.shard_names:
                raise ValueError(f"unknown shard {shard_id!r}; this layer has {self.shard_names}")
            return self.shard_names.index(shard_id)
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard index {shard_id} out of range for {len(self.output_sizes)} parts")
        return shard_id

    def load(self, write: Any, global_shape: list[int], array: Any, shard_id: int | str | None) -> None:
        """Call write(this rank's columns of one part, destination column) for each part `array` holds."""
        if shard_id is None:
            if list(array.shape) != list(global_shape):
                raise ValueError(f"fused tensor: got shape {list(array.shape)} (as the parameter is laid out), "
                                 f"the model expects {list(global_shape)}")
            for i in range(len(self.output_sizes)):
                self.load(write, global_shape, array[..., self.offsets[i]:self.offsets[i + 1]], i)
            return
        i = self.index(shard_id)
        expected = list(global_shape[:-1]) + [self.output_sizes[i]]
        if list(array.shape) != expected:
            name = self.shard_names[i] if self.shard_names else str(i)
            raise ValueError(f"part {name!r}: got shape {list(array.shape)} (as the parameter is laid out), "
                             f"the model expects {expected}")
        lo, hi = self.slices[i]
        write(array[..., lo:hi], self.local_offsets[i])


class MergedLinear(PackedMatmul, nn.Layer):
    """Several projections of the same input computed in one GEMM (q|k|v, gate|up), column-parallel:
    each rank keeps the range `slices[i]` of part i (all of it by default, or an equal share when `tp`
    has several ranks)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 shard_names: Sequence[str] | None = None, slices: Sequence[tuple[int, int]] | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp if tp is not None else current_tp()
        self.in_features = in_features
        self.parts = Parts(output_sizes, shard_names,
                           slices if slices is not None else [even_slice(s, tp) for s in output_sizes])
        self.local_sizes = self.parts.local_sizes
        total, local = sum(self.parts.output_sizes), sum(self.local_sizes)
        self.out_features = local
        self.weight = _new_weight(self, in_features, local, [in_features, total], self.weight_loader,
                                  part_sizes=self.parts.named_sizes)
        self.bias = _zeros_param(self, [local], [total]) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader
            self.bias.part_sizes = self.parts.named_sizes

    def split(self, y: paddle.Tensor) -> list[paddle.Tensor]:
        return paddle.split(y, self.local_sizes, axis=-1)

    def weight_loader(self, slot: WeightSlot, array: Any, shard_id: int | str | None = None) -> None:
        self.parts.load(lambda part, col: slot.target.fill(part, col), slot.global_shape, array, shard_id)

    def bias_loader(self, param: paddle.Tensor, array: Any, shard_id: int | str | None = None) -> None:
        def write(part: Any, col: int) -> None:
            with paddle.no_grad():
                param[col:col + part.shape[-1]] = paddle.to_tensor(np.asarray(part, dtype=np.float32))

        self.parts.load(write, param.global_shape, array, shard_id)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class GatedMLP(nn.Layer):
    """down(silu(gate(x)) * up(x)), gate and up fused into one GEMM (`up_gate_proj` = [gate | up], the
    order of Paddle checkpoints; HF's separate gate_proj / up_proj load into its two parts).
    Column-parallel gate/up and row-parallel down over `tp` (default: the group being built for)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu",
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        tp = tp if tp is not None else current_tp()
        self.up_gate_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias,
                                         shard_names=["gate", "up"], tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, x: paddle.Tensor, reduce: bool = True) -> paddle.Tensor:
        return self.down_proj(ops.silu_and_mul(self.up_gate_proj(x)), reduce=reduce)  # [gate | up] fused
