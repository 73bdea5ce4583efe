"""SiLU-and-multiply of a fused gate | up projection; quick GELU (the ERNIE-4.5-VL vision MLP)."""
from __future__ import annotations

import paddle
import paddle.nn.functional as F

from fastdeploy.ops.build import call_op, compiled


def silu_and_mul_reference(x: paddle.Tensor) -> paddle.Tensor:
    gate, up = paddle.split(x, 2, axis=-1)
    return F.silu(gate) * up


def silu_and_mul(x: paddle.Tensor, *, use_compiled: bool = True) -> paddle.Tensor:
    """x [..., 2F] = gate | up (float32) -> silu(gate) * up [..., F]."""
    lib = compiled(use_compiled)
    if lib is None:
        return silu_and_mul_reference(x)
    return call_op(lib, "fd_silu_mul", x)[0]


def quick_gelu_reference(x: paddle.Tensor) -> paddle.Tensor:
    return x * F.sigmoid(1.702 * x)


def quick_gelu(x: paddle.Tensor, *, use_compiled: bool = True) -> paddle.Tensor:
    """x * sigmoid(1.702 x), element by element (float32)."""
    lib = compiled(use_compiled)
    if lib is None:
        return quick_gelu_reference(x)
    return call_op(lib, "fd_quick_gelu", x)[0]
