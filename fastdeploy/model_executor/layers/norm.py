"""RMSNorm, computed in float32 as transformers does."""
from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy.model_executor.layers.linear import default_weight_loader


class RMSNorm(nn.Layer):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], dtype="float32",
                                            default_initializer=nn.initializer.Constant(1.0))
        self.weight.stop_gradient = True
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: paddle.Tensor, residual: paddle.Tensor | None = None
                ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        """With `residual`, first adds it to x and returns (normed, x + residual) for the next block."""
        if residual is not None:
            x = x + residual
            residual = x
        variance = paddle.mean(paddle.square(x), axis=-1, keepdim=True)
        out = x * paddle.rsqrt(variance + self.eps) * self.weight
        return out if residual is None else (out, residual)
