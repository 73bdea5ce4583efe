"""One forward step from its plain inputs: what rank 0 runs and, under tensor parallel, sends to
every worker rank so that all ranks run the same forward (and the same collectives) on their shards."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import paddle
from paddle import nn

from fastdeploy.model_executor.forward_context import build_forward_context, forward_context
from fastdeploy.worker.step_types import ForwardBatch


@paddle.no_grad()
def run_step(model: nn.Layer, inputs: ForwardBatch, block_size: int,
             kv_caches: Sequence[paddle.Tensor]) -> paddle.Tensor | None:
    """Forward the batch through the model (writing its K/V into the cache) and return the logits
    [N, vocab] of `logit_rows` (None when no row needs them)."""
    ctx = build_forward_context(inputs.query_lens, inputs.context_lens, inputs.block_tables, block_size, kv_caches)
    with forward_context(ctx):
        hidden = model(paddle.to_tensor(inputs.token_ids), paddle.to_tensor(inputs.positions))
    if not len(inputs.logit_rows):
        return None
    return model.compute_logits(paddle.gather(hidden, paddle.to_tensor(inputs.logit_rows)))


def warmup_inputs(num_tokens: int, block_size: int) -> ForwardBatch:
    """One request of `num_tokens` zeros in the first blocks, with the last row's logits."""
    blocks = list(range(-(-num_tokens // block_size)))
    return ForwardBatch(np.zeros(num_tokens, np.int64), np.arange(num_tokens, dtype=np.int64), [num_tokens],
                       [num_tokens], [blocks], np.asarray([num_tokens - 1], np.int64))
