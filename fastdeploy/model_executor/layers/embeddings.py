"""Token embedding and the LM head (which may share the embedding's weight), vocab-parallel.

With several tensor-parallel ranks, rank r keeps the vocabulary rows [r * per, (r + 1) * per),
per = ceil(vocab / ranks) (the last rank's surplus rows stay zero). The embedding looks up the ids
it owns, zeros the others and all-reduces, so every rank gets exactly the owner's row; the LM head
computes the logits of its rows and all-gathers them. A tied LM head and the embedding share one
packed table.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import ops
from fastdeploy.distributed.parallel_state import TPGroup, current_tp
from fastdeploy.model_executor.layers.linear import PackedMatmul, _check_shape
from fastdeploy.model_executor.layers.packed import PackedParameter, WeightSlot, add_slot


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first id, end id, rows per rank) of this rank's vocabulary shard."""
    per = -(-vocab_size // tp.size)
    lo = min(tp.rank * per, vocab_size)
    return lo, min(lo + per, vocab_size), per


def _table(vocab_size: int, hidden_size: int, tp: TPGroup) -> tuple[PackedParameter, int, int]:
    """This rank's share of the vocabulary table as a packed [hidden, rows] matrix (rows per rank)."""
    lo, hi, per = vocab_range(vocab_size, tp)
    return PackedParameter(hidden_size, per, role="table"), lo, hi


def _fill_rows(weight: PackedParameter, rows: Any, count: int) -> None:
    """Pack `rows` ([hidden, count] view) into the first columns; the last rank's surplus columns
    (ids past the vocabulary) get zeros."""
    weight.fill(rows)
    if weight.n > count:
        weight.fill(np.zeros((weight.k, weight.n - count), dtype=np.float32), col0=count)


class VocabEmbedding(nn.Layer):
    """The token table [vocab_size, hidden_size] (this rank's rows; the same orientation in HF and Paddle
    checkpoints), held packed as [hidden, rows] so that a tied LM head multiplies by the same bytes;
    a lookup dequantizes the rows it needs."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else current_tp()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight, self.lo, self.hi = _table(vocab_size, hidden_size, self.tp)
        add_slot(self, "weight", WeightSlot(self.weight, [vocab_size, hidden_size], self.weight_loader,
                                            linear_in_out=False, dense=lambda: self.weight.dense().T))

    def weight_loader(self, slot: WeightSlot, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"the embedding has no shards (got shard {shard_id!r})")
        _check_shape(slot, array, "weight")
        _fill_rows(self.weight, array[self.lo:self.hi].T, self.hi - self.lo)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        if self.tp.size == 1:
            return ops.embedding_lookup(input_ids, self.weight.value)
        mine = (input_ids >= self.lo) & (input_ids < self.hi)
        local = paddle.where(mine, input_ids - self.lo, paddle.zeros_like(input_ids))
        rows = ops.embedding_lookup(local, self.weight.value) * mine.unsqueeze(-1).astype("float32")
        return self.tp.all_reduce(rows)


class LMHead(PackedMatmul, nn.Layer):
    """logits = hidden @ W. Untied: own weight [hidden, vocab] (checkpoint `lm_head.weight`; this
    rank's columns). Tied: the embedding's packed table, the same bytes. Every rank returns the full
    [N, vocab] logits."""

    def __init__(self, hidden_size: int, vocab_size: int, tied_embedding: VocabEmbedding | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else current_tp()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.tied = tied_embedding is not None
        if tied_embedding is not None:
            self.weight, self.lo, self.hi = tied_embedding.weight, tied_embedding.lo, tied_embedding.hi
        else:
            self.weight, self.lo, self.hi = _table(vocab_size, hidden_size, self.tp)
            add_slot(self, "weight", WeightSlot(self.weight, [hidden_size, vocab_size], self.weight_loader))

    def weight_loader(self, slot: WeightSlot, array: Any, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"lm_head has no shards (got shard {shard_id!r})")
        _check_shape(slot, array, "weight")
        _fill_rows(self.weight, array[:, self.lo:self.hi], self.hi - self.lo)

    def forward(self, hidden: paddle.Tensor) -> paddle.Tensor:
        logits = self.matmul(hidden)
        if self.tp.size == 1:
            return logits
        return self.tp.gather_to_first(logits)[:, :self.vocab_size]
