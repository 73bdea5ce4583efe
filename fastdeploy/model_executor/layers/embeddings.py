"""Token embedding and the LM head (which may share the embedding's weight), vocab-parallel.

With several tensor-parallel ranks, rank r keeps the vocabulary rows [r * per, (r + 1) * per),
per = ceil(vocab / ranks) (the last rank's surplus rows stay zero). The embedding looks up the ids
it owns, zeros the others and all-reduces, so every rank gets exactly the owner's row; the LM head
computes the logits of its rows and all-gathers them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy import ops
from fastdeploy.distributed.parallel_state import TPGroup, current_tp
from fastdeploy.model_executor.layers.linear import PackedMatmul, _check_shape


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first id, end id, rows per rank) of this rank's vocabulary shard."""
    per = -(-vocab_size // tp.size)
    lo = min(tp.rank * per, vocab_size)
    return lo, min(lo + per, vocab_size), per


class VocabEmbedding(nn.Layer):
    """weight [vocab_size, hidden_size] (this rank's rows), the same orientation in HF and Paddle checkpoints."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else current_tp()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.lo, self.hi, per = vocab_range(vocab_size, self.tp)
        self.weight = self.create_parameter([per, hidden_size], dtype="float32",
                                            default_initializer=nn.initializer.Constant(0.0))
        self.weight.stop_gradient = True
        self.weight.global_shape = [vocab_size, hidden_size]
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: paddle.Tensor, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"the embedding has no shards (got shard {shard_id!r})")
        _check_shape(param, array, "weight")
        rows = np.zeros(param.shape, dtype=np.float32)
        rows[:self.hi - self.lo] = np.asarray(array[self.lo:self.hi], dtype=np.float32)
        param.set_value(rows)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.lo) & (input_ids < self.hi)
        local = paddle.where(mine, input_ids - self.lo, paddle.zeros_like(input_ids))
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).astype(self.weight.dtype)
        return self.tp.all_reduce(rows)


class LMHead(PackedMatmul, nn.Layer):
    """logits = hidden @ W. Untied: own weight [hidden, vocab] (checkpoint `lm_head.weight`; this
    rank's columns). Tied: the embedding's [vocab, hidden] weight (its rows), used transposed; no
    parameter of its own. Every rank returns the full [N, vocab] logits."""

    def __init__(self, hidden_size: int, vocab_size: int, tied_embedding: VocabEmbedding | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else current_tp()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.lo, self.hi, per = vocab_range(vocab_size, self.tp)
        # A plain attribute (not a sublayer) so the shared weight is not registered twice.
        self.__dict__["_tied"] = tied_embedding
        if tied_embedding is None:
            self.weight = self.create_parameter([hidden_size, per], dtype="float32",
                                                default_initializer=nn.initializer.Constant(0.0))
            self.weight.stop_gradient = True
            self.weight.global_shape = [hidden_size, vocab_size]
            self.weight.weight_loader = self.weight_loader
            self.weight.linear_in_out = True
        else:
            self.weight = None

    @property
    def tied(self) -> bool:
        return self._tied is not None

    def dense_weight(self) -> np.ndarray:
        # Tied: the head packs its own copy of the table; the embedding keeps its rows for lookups.
        if self.packed is None and self._tied is not None:
            return np.from_dlpack(self._tied.weight).T
        return super().dense_weight()

    def stored_bf16(self) -> bool:
        return bool(getattr(self._tied.weight if self._tied is not None else self.weight, "stored_bf16", False))

    def weight_loader(self, param: paddle.Tensor, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"lm_head has no shards (got shard {shard_id!r})")
        _check_shape(param, array, "weight")
        cols = np.zeros(param.shape, dtype=np.float32)
        cols[:, :self.hi - self.lo] = np.asarray(array[:, self.lo:self.hi], dtype=np.float32)
        param.set_value(cols)

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        if self.packed is not None:
            logits = ops.weight_only_linear(hidden, self.packed)
        elif self._tied is not None:
            logits = paddle.matmul(hidden, self._tied.weight, transpose_y=True)
        else:
            logits = paddle.matmul(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[:, :self.vocab_size]
