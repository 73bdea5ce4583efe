"""RMSNorm (fused with the residual add), computed in float32 as transformers does, by the compiled op."""
from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy import ops
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
        return ops.rms_norm(x, self.weight, self.eps, residual)
