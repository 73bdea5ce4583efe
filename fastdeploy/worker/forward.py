"""One step's forward on this rank's shard, layer by layer: what rank 0's ModelRunner and every worker rank run
(the compiled step, compiled_step.py, is rank 0's alone), and what each rank holds for it: its shard of the model
(`load_shard`) and its KV heads of every cache block (`rank_kv_caches`). Vision rows of multimodal steps come from
`VisionCache`."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import paddle
from paddle import nn

from fastdeploy import ops
from fastdeploy.config import EngineConfig
from fastdeploy.distributed.parallel_state import TPGroup, kv_heads_per_rank
from fastdeploy.model_executor.forward_context import allocate_kv_caches, build_forward_context, forward_context
from fastdeploy.model_executor.load import load_model
from fastdeploy.step_types import ForwardBatch, VisionSlice


def load_shard(config: EngineConfig, tp: TPGroup) -> nn.Layer:
    """This rank's shard of the model; afterwards activations reuse heap memory instead of fresh pages."""
    model = load_model(config.model_config, tp, config.quant, dtype=config.dtype, lm_head_fp32=config.lm_head_fp32,
                       mtp_weights=config.mtp_weights)
    ops.keep_freed_memory()
    return model


def rank_kv_caches(config: EngineConfig, num_blocks: int, tp_size: int) -> list[paddle.Tensor]:
    """This rank's KV caches: every rank holds the same blocks, each its own KV heads."""
    mc = config.model_config
    return allocate_kv_caches(config.num_kv_layers, num_blocks, config.block_size,
                              kv_heads_per_rank(mc.num_key_value_heads, tp_size), mc.head_dim, config.kv_cache_dtype)


@paddle.no_grad()
def run_step(model: nn.Layer, inputs: ForwardBatch, block_size: int,
             kv_caches: Sequence[paddle.Tensor], vision: VisionCache | None = None) -> paddle.Tensor | None:
    """Forward the batch through the model (writing its K/V into the cache) and return the logits
    [N, vocab] of `logit_rows` (None when no row needs them). A multimodal step also passes its token
    types and the vision rows of its placeholders (encoded through `vision`)."""
    return _logits(model, inputs, forward_hidden(model, inputs, block_size, kv_caches, vision))


@paddle.no_grad()
def forward_hidden(model: nn.Layer, inputs: ForwardBatch, block_size: int, kv_caches: Sequence[paddle.Tensor],
                   vision: VisionCache | None = None) -> paddle.Tensor:
    """run_step's forward: the final hidden states of every row [T, hidden]."""
    ctx = build_forward_context(inputs.query_lens, inputs.context_lens, inputs.block_tables, block_size, kv_caches)
    with forward_context(ctx):
        if inputs.token_types is None:
            return model(paddle.to_tensor(inputs.token_ids), paddle.to_tensor(inputs.positions))
        rows = (vision or VisionCache()).rows(model, inputs.vision)
        return model(paddle.to_tensor(inputs.token_ids), paddle.to_tensor(inputs.positions),
                     paddle.to_tensor(inputs.token_types), rows)


def _logits(model: nn.Layer, inputs: ForwardBatch, hidden: paddle.Tensor) -> paddle.Tensor | None:
    if not len(inputs.logit_rows):
        return None
    return model.compute_logits(paddle.gather(hidden, paddle.to_tensor(inputs.logit_rows)))


def run_step_keeping(model: nn.Layer, inputs: ForwardBatch, block_size: int, kv_caches: Sequence[paddle.Tensor],
                     vision: VisionCache | None = None) -> tuple[paddle.Tensor | None, np.ndarray]:
    """run_step, and the final hidden states of the batch's hidden_rows (numpy) for the MTP layer."""
    hidden = forward_hidden(model, inputs, block_size, kv_caches, vision)
    kept = paddle.gather(hidden, paddle.to_tensor(inputs.hidden_rows)).numpy() if len(inputs.hidden_rows) else \
        np.zeros((0, hidden.shape[-1]), np.float32)
    return _logits(model, inputs, hidden), kept


class VisionCache:
    """Encoded vision rows per request, in prompt order: encoded at the first step that needs them, dropped
    once the step using the last row has run. A request whose prefill skips a step (preempted, aborted, or
    left without budget) is dropped too and re-encodes if it comes back: nothing outlives its request."""

    def __init__(self) -> None:
        self.encoded: dict[str, paddle.Tensor] = {}

    def rows(self, model: nn.Layer, slices: Sequence[VisionSlice]) -> paddle.Tensor | None:
        wanted = {item.key for item in slices}
        self.encoded = {k: v for k, v in self.encoded.items() if k in wanted}
        parts = []
        for item in slices:
            encoded = self.encoded.get(item.key)
            if encoded is None:
                raw = model.encode_vision(paddle.to_tensor(item.pixel_values), item.grid_thw)
                encoded = paddle.gather(raw, paddle.to_tensor(item.row_order))
                self.encoded[item.key] = encoded
            if item.hi > item.lo:
                parts.append(encoded[item.lo:item.hi])
            if item.hi == item.row_order.size:
                del self.encoded[item.key]
        return paddle.concat(parts) if parts else None


def warmup_inputs(num_tokens: int, block_size: int) -> ForwardBatch:
    """One request of `num_tokens` zeros in the first blocks, with the last row's logits."""
    blocks = np.arange(-(-num_tokens // block_size), dtype=np.int64)[None]
    lens = np.asarray([num_tokens], np.int64)
    return ForwardBatch(np.zeros(num_tokens, np.int64), np.arange(num_tokens, dtype=np.int64), lens, lens, blocks,
                        lens - 1)
