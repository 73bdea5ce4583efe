"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

import paddle

from fastdeploy.ops.build import call_op, compiled


def rms_norm_reference(x: paddle.Tensor, weight: paddle.Tensor, eps: float, residual: paddle.Tensor | None = None
                       ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
    """Pure Paddle: with `residual`, x + residual is normalised and also returned as the new residual."""
    if residual is not None:
        x = x + residual
        residual = x
    variance = paddle.mean(paddle.square(x), axis=-1, keepdim=True)
    out = x * paddle.rsqrt(variance + eps) * weight
    return out if residual is None else (out, residual)


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float = 1e-6, residual: paddle.Tensor | None = None, *,
             use_compiled: bool = True) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
    """x [..., n] float32, weight [n] -> normed [..., n]; with `residual` (x's shape) returns
    (normed(x + residual), x + residual). Inputs are not modified."""
    lib = compiled(use_compiled)
    if lib is None:
        return rms_norm_reference(x, weight, eps, residual)
    if residual is None:
        return call_op(lib, "fd_rms_norm", x, weight, float(eps))[0]
    out, new_residual = call_op(lib, "fd_add_rms_norm", x, residual, weight, float(eps))
    return out, new_residual
