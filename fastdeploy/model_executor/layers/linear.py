"""Linear layers that know how to take their weights from a checkpoint.

Weights are kept as Paddle keeps them, [in, out], so the forward is one `x @ W` GEMM. Every
parameter has a `weight_loader(param, array, shard_id)` that receives the checkpoint tensor already
in [in, out] orientation (load.py transposes HF-layout tensors); a tensor-parallel variant would
override these loaders to keep only its shard.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import paddle
from paddle import nn


def _zeros_param(layer: nn.Layer, shape: list[int]) -> paddle.Tensor:
    # Zero init is cheap; real values always come from the checkpoint.
    param = layer.create_parameter(shape, dtype="float32", default_initializer=nn.initializer.Constant(0.0))
    param.stop_gradient = True
    return param


def _check_shape(param: paddle.Tensor, array: np.ndarray, what: str) -> None:
    if tuple(array.shape) != tuple(param.shape):
        raise ValueError(f"{what}: got shape {list(array.shape)} (as the parameter is laid out), "
                         f"the model expects {list(param.shape)}")


def default_weight_loader(param: paddle.Tensor, array: np.ndarray, shard_id: int | str | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {list(param.shape)} has no shards (got shard {shard_id!r})")
    _check_shape(param, array, "weight")
    param.set_value(np.asarray(array, dtype=np.float32))


class Linear(nn.Layer):
    """y = x @ W (+ b); W is [in_features, out_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _zeros_param(self, [in_features, out_features])
        self.bias = _zeros_param(self, [out_features]) if bias else None
        self.weight.linear_in_out = True  # HF checkpoints store it [out, in]: load.py transposes those
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: paddle.Tensor, array: np.ndarray, shard_id: int | str | None = None) -> None:
        default_weight_loader(param, array, shard_id)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = paddle.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class MergedLinear(Linear):
    """Several projections of the same input computed in one GEMM (q|k|v, gate|up).

    The output axis is the concatenation of `output_sizes`; checkpoints may give each part separately
    (shard_id = index or name) or already fused (shard_id None: split here so per-part loaders, and
    later a tensor-parallel split, see the same pieces).
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 shard_names: Sequence[str] | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names) if shard_names is not None else []
        self.offsets = np.concatenate([[0], np.cumsum(self.output_sizes)]).tolist()
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
        return paddle.split(y, self.output_sizes, axis=-1)

    def weight_loader(self, param: paddle.Tensor, array: np.ndarray, shard_id: int | str | None = None) -> None:
        if shard_id is None:
            _check_shape(param, array, "fused tensor")
            for i in range(len(self.output_sizes)):
                lo, hi = self.offsets[i], self.offsets[i + 1]
                self.weight_loader(param, array[..., lo:hi], i)
            return
        i = self.shard_index(shard_id)
        lo, hi = self.offsets[i], self.offsets[i + 1]
        expected = list(param.shape[:-1]) + [hi - lo]
        if list(array.shape) != expected:
            name = self.shard_names[i] if self.shard_names else str(i)
            raise ValueError(f"part {name!r}: got shape {list(array.shape)} (as the parameter is laid out), "
                             f"the model expects {expected}")
        with paddle.no_grad():
            param[..., lo:hi] = paddle.to_tensor(np.ascontiguousarray(array, dtype=np.float32))


class GatedMLP(nn.Layer):
    """down(silu(gate(x)) * up(x)), gate and up fused into one GEMM (`up_gate_proj` = [gate | up], the
    order of Paddle checkpoints; HF's separate gate_proj / up_proj load into its two parts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        self.up_gate_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias,
                                         shard_names=["gate", "up"])
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        gate, up = self.up_gate_proj.split(self.up_gate_proj(x))
        return self.down_proj(paddle.nn.functional.silu(gate) * up)
