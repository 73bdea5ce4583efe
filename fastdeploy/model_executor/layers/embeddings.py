"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.model_executor.layers.linear import default_weight_loader


class VocabEmbedding(nn.Layer):
    """weight [vocab_size, hidden_size], the same orientation in HF and Paddle checkpoints."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = self.create_parameter([vocab_size, hidden_size], dtype="float32",
                                            default_initializer=nn.initializer.Constant(0.0))
        self.weight.stop_gradient = True
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Layer):
    """logits = hidden @ W. Untied: own weight [hidden, vocab] (checkpoint `lm_head.weight`).
    Tied: the embedding's [vocab, hidden] weight, used transposed; no parameter of its own."""

    def __init__(self, hidden_size: int, vocab_size: int, tied_embedding: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        # A plain attribute (not a sublayer) so the shared weight is not registered twice.
        self.__dict__["_tied"] = tied_embedding
        if tied_embedding is None:
            self.weight = self.create_parameter([hidden_size, vocab_size], dtype="float32",
                                                default_initializer=nn.initializer.Constant(0.0))
            self.weight.stop_gradient = True
            self.weight.weight_loader = default_weight_loader
            self.weight.linear_in_out = True
        else:
            self.weight = None

    @property
    def tied(self) -> bool:
        return self._tied is not None

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        if self._tied is not None:
            return paddle.matmul(hidden, self._tied.weight, transpose_y=True)
        return paddle.matmul(hidden, self.weight)
