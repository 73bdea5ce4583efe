"""Embedding lookup from a packed table: the table [vocab, hidden] is held as the packed matrix
W [hidden, vocab] that the LM head multiplies by (ops.quant layouts), so a tied model stores it once.
Row `id` of the table is column `id` of W, dequantized."""
from __future__ import annotations

import paddle

from fastdeploy.ops.build import call_op, compiled
from fastdeploy.ops.quant import FORMATS, PackedWeight, unpack_weight


def embedding_lookup_reference(ids: paddle.Tensor, table: PackedWeight) -> paddle.Tensor:
    """Pure Paddle: ids [T] int -> [T, hidden] float32."""
    return paddle.gather(unpack_weight(table).T, ids.reshape([-1]))


def embedding_lookup(ids: paddle.Tensor, table: PackedWeight, *, use_compiled: bool = True) -> paddle.Tensor:
    """ids [T] int32/int64 in [0, table.n) -> rows [T, table.k] float32."""
    if not isinstance(table, PackedWeight):
        raise TypeError(f"table must be a PackedWeight, got {type(table).__name__}")
    lib = compiled(use_compiled)
    if lib is None:
        return embedding_lookup_reference(ids, table)
    flat = ids.reshape([-1])
    return call_op(lib, "fd_embedding", flat, table.data, table.scales, FORMATS[table.fmt], int(table.k),
                   int(table.n))[0]
