"""Linear layers that know how to take their weights from a checkpoint, whole or as a tensor-parallel shard.

Weights load as Paddle keeps them, [in, out] float32, so the forward is one `x @ W` GEMM. Every
parameter has a `weight_loader(param, array, shard_id)` that receives the checkpoint tensor already
in [in, out] orientation (load.py transposes HF-layout tensors) and still lazy (load.LazyArray), so
a sharded layer converts only the slice its rank keeps. `param.global_shape` is the unsharded shape
the checkpoint must have.

Tensor parallel (Megatron style): `MergedLinear` is column-parallel (each rank keeps a slice of
every part's outputs: whole heads of q/k/v, an equal share of gate and up), `RowParallelLinear`
keeps a slice of the inputs and sums the ranks' partial products. A column-parallel layer followed
by a row-parallel one needs a single all-reduce.

After loading, `weight_format.pack_weights` repacks every `PackedMatmul` layer's weight for the
compiled weight-only GEMM (fp32, bf16, int8 or int4) and drops the float32 parameter.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle

from paddle import nn

from fastdeploy import ops
from fastdeploy.distributed.parallel_state import TPGroup, current_tp, kv_head_start, kv_heads_per_rank


def _zeros_param(layer: nn.Layer, shape: list[int], global_shape: list[int] | None = None) -> paddle.Tensor:
    # Zero init is cheap; real values always come from the checkpoint.
    param = layer.create_parameter(shape, dtype="float32", default_initializer=nn.initializer.Constant(0.0))
    param.stop_gradient = True
    param.global_shape = list(global_shape if global_shape is not None else shape)
    return param


def _check_shape(param: paddle.Tensor, array: Any, what: str) -> None:
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
    """Mixin of the layers computing x @ W: through `paddle.matmul` on the float32 parameter until
    `pack` replaces it by packed weights for `ops.weight_only_linear`."""

    packed: ops.PackedWeight | None = None
    quantizable = True  # False keeps the layer in fp32/bf16 under quantization (e.g. an MoE router)

    def dense_weight(self) -> np.ndarray:
        """The float32 [in, out] matrix this layer multiplies by (unpacked once packed; before that a
        view of the parameter's memory)."""
        if self.packed is not None:
            return ops.unpack_weight(self.packed).numpy()
        return np.from_dlpack(self.weight)

    def stored_bf16(self) -> bool:
        """Whether every checkpoint tensor loaded into the weight was bfloat16 (so bf16 packing is exact)."""
        return bool(getattr(self.weight, "stored_bf16", False))

    def pack(self, fmt: str) -> None:
        self.packed = ops.pack_weight(self.dense_weight(), fmt)
        self.weight = None  # the float32 copy is no longer needed

    def matmul(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.packed is not None:
            return ops.weight_only_linear(x, self.packed)
        return paddle.matmul(x, self.weight)


class Linear(PackedMatmul, nn.Layer):
    """y = x @ W (+ b); W is [in_features, out_features]. Replicated on every tensor-parallel rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _zeros_param(self, [in_features, out_features])
        self.bias = _zeros_param(self, [out_features]) if bias else None
        self.weight.linear_in_out = True  # HF checkpoints store it [out, in]: load.py transposes those
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: paddle.Tensor, array: Any, shard_id: int | str | None = None) -> None:
        default_weight_loader(param, array, shard_id)

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
        self.weight = _zeros_param(self, [self.hi - self.lo, out_features], [in_features, out_features])
        self.bias = _zeros_param(self, [out_features]) if bias else None  # whole, added once
        self.weight.linear_in_out = True
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: paddle.Tensor, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"parameter of shape {list(param.shape)} has no shards (got shard {shard_id!r})")
        _check_shape(param, array, "weight")
        param.set_value(np.asarray(array[self.lo:self.hi], dtype=np.float32))

    def forward(self, x: paddle.Tensor, reduce: bool = True) -> paddle.Tensor:
        """reduce=False returns this rank's partial sum (bias on rank 0 only), for a caller that adds
        several partial sums before one all-reduce."""
        y = self.matmul(x)
        if reduce:
            y = self.tp.all_reduce(y)
            return y if self.bias is None else y + self.bias
        return y if self.bias is None or self.tp.rank != 0 else y + self.bias


class MergedLinear(PackedMatmul, nn.Layer):
    """Several projections of the same input computed in one GEMM (q|k|v, gate|up), column-parallel.

    The output axis is the concatenation of `output_sizes`; each rank keeps the range `slices[i]`
    of part i (all of it by default, or an equal share when `tp` has several ranks). Checkpoints may
    give each part separately (shard_id = index or name) or already fused (shard_id None: split here
    so per-part loaders see the same pieces).
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 shard_names: Sequence[str] | None = None, slices: Sequence[tuple[int, int]] | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp if tp is not None else current_tp()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)  # of the whole (unsharded) layer
        self.shard_names = list(shard_names) if shard_names is not None else []
        self.slices = list(slices) if slices is not None else [even_slice(s, tp) for s in self.output_sizes]
        self.local_sizes = [hi - lo for lo, hi in self.slices]
        self.offsets = np.concatenate([[0], np.cumsum(self.output_sizes)]).tolist()
        self.local_offsets = np.concatenate([[0], np.cumsum(self.local_sizes)]).tolist()
        total, local = sum(self.output_sizes), sum(self.local_sizes)
        self.out_features = local
        self.weight = _zeros_param(self, [in_features, local], [in_features, total])
        self.bias = _zeros_param(self, [local], [total]) if bias else None
        self.weight.linear_in_out = True
        for p in self.parameters():
            p.weight_loader = self.weight_loader
        if self.shard_names:
            if len(self.shard_names) != len(self.output_sizes):
                raise ValueError(f"shard_names {self.shard_names} must name each of the {len(self.output_sizes)} parts")
            for p in self.parameters():
                p.part_sizes = dict(zip(self.shard_names, self.output_sizes))  # lets load.py check part shapes

    def shard_index(self, shard_id: int | str) -> int:
        if isinstance(shard_id, str):
            if shard_id not in self.shard_names:
                raise ValueError(f"unknown shard {shard_id!r}; this layer has {self.shard_names}")
            return self.shard_names.index(shard_id)
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard index {shard_id} out of range for {len(self.output_sizes)} parts")
        return shard_id

    def split(self, y: paddle.Tensor) -> list[paddle.Tensor]:
        return paddle.split(y, self.local_sizes, axis=-1)

    def weight_loader(self, param: paddle.Tensor, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is None:
            _check_shape(param, array, "fused tensor")
            for i in range(len(self.output_sizes)):
                lo, hi = self.offsets[i], self.offsets[i + 1]
                self.weight_loader(param, array[..., lo:hi], i)
            return
        i = self.shard_index(shard_id)
        expected = list(param.global_shape[:-1]) + [self.output_sizes[i]]
        if list(array.shape) != expected:
            name = self.shard_names[i] if self.shard_names else str(i)
            raise ValueError(f"part {name!r}: got shape {list(array.shape)} (as the parameter is laid out), "
                             f"the model expects {expected}")
        lo, hi = self.slices[i]
        dst = self.local_offsets[i]
        with paddle.no_grad():
            param[..., dst:dst + hi - lo] = paddle.to_tensor(np.ascontiguousarray(array[..., lo:hi], dtype=np.float32))

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
