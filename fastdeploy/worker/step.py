"""One forward step from its plain inputs: what rank 0 runs and, under tensor parallel, sends to
every worker rank so that all ranks run the same forward (and the same collectives) on their shards."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import paddle
from paddle import nn

from fastdeploy.model_executor.forward_context import build_forward_context, forward_context


@dataclass(slots=True)
class StepInputs:
    """The step's ragged batch: the few arrays the forward context is built from (small to send)."""

    token_ids: np.ndarray  # [T] int64, request after request
    positions: np.ndarray  # [T] int64
    query_lens: list[int]  # new tokens per request
    context_lens: list[int]  # tokens per request once this step's are added
    block_tables: list[list[int]]  # KV blocks of each request
    logit_rows: np.ndarray  # [N] int64: rows of the hidden states whose logits are needed (may be empty)


@paddle.no_grad()
def run_step(model: nn.Layer, inputs: StepInputs, block_size: int,
             kv_caches: Sequence[paddle.Tensor]) -> paddle.Tensor | None:
    """Forward the batch through the model (writing its K/V into the cache) and return the logits
    [N, vocab] of `logit_rows` (None when no row needs them)."""
    ctx = build_forward_context(inputs.query_lens, inputs.context_lens, inputs.block_tables, block_size, kv_caches)
    with forward_context(ctx):
        hidden = model(paddle.to_tensor(inputs.token_ids), paddle.to_tensor(inputs.positions))
    if not len(inputs.logit_rows):
        return None
    return model.compute_logits(paddle.gather(hidden, paddle.to_tensor(inputs.logit_rows)))


def warmup_inputs(num_tokens: int, block_size: int) -> StepInputs:
    """One request of `num_tokens` zeros in the first blocks, with the last row's logits."""
    blocks = list(range(-(-num_tokens // block_size)))
    return StepInputs(np.zeros(num_tokens, np.int64), np.arange(num_tokens, dtype=np.int64), [num_tokens],
                      [num_tokens], [blocks], np.asarray([num_tokens - 1], np.int64))
