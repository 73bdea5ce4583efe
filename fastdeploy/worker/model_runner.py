"""ModelRunner: owns the model and the KV cache, and turns a step's SchedulerOutput (plain arrays) into
a ModelRunnerOutput: sampled token ids and the logprobs asked for. It never sees a request.

The step's tokens are one ragged batch (no padding); only the rows the engine marked get logits: the
requests that catch up with their known tokens this step sample one token, and prompt rows of
requests that asked for prompt logprobs give those. `execute` forwards the step and hands it to the sampling
stage (fastdeploy/sampling/stage.py), which also decides when the compiled step takes the tokens inside its
forward call.
"""
from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import paddle
from paddle import nn

from fastdeploy import ops
from fastdeploy.config import EngineConfig
from fastdeploy.distributed.parallel_state import SINGLE, kv_heads_per_rank
from fastdeploy.model_executor.forward_context import allocate_kv_caches, build_forward_context, forward_context
from fastdeploy.model_executor.load import load_model
from fastdeploy.model_executor.memory_plan import available_memory_bytes, host_memory_bytes, resident_bytes
from fastdeploy.ops.kv_cache import row_bytes
from fastdeploy.sampling.logprobs import log_softmax  # noqa: F401  (re-export: tests/test_logprobs_n_stream.py)
from fastdeploy.sampling.stage import SamplingStage, sample_in_forward
from fastdeploy.step_types import ForwardBatch, ModelRunnerOutput, SchedulerOutput, VisionSlice
from fastdeploy.worker import messages
from fastdeploy.worker.compiled_step import CompiledDecoder
from fastdeploy.worker.worker_group import WorkerError, WorkerGroup, deferred_sigint

logger = logging.getLogger(__name__)

ACTIVATION_RESERVE = 0.1  # share of the memory budget kept for activations


@paddle.no_grad()
def run_step(model: nn.Layer, inputs: ForwardBatch, block_size: int,
             kv_caches: Sequence[paddle.Tensor], vision: VisionCache | None = None) -> paddle.Tensor | None:
    """Forward the batch through the model (writing its K/V into the cache) and return the logits
    [N, vocab] of `logit_rows` (None when no row needs them). A multimodal step also passes its token
    types and the vision rows of its placeholders (encoded through `vision`)."""
    ctx = build_forward_context(inputs.query_lens, inputs.context_lens, inputs.block_tables, block_size, kv_caches)
    with forward_context(ctx):
        if inputs.token_types is None:
            hidden = model(paddle.to_tensor(inputs.token_ids), paddle.to_tensor(inputs.positions))
        else:
            rows = (vision or VisionCache()).rows(model, inputs.vision)
            hidden = model(paddle.to_tensor(inputs.token_ids), paddle.to_tensor(inputs.positions),
                           paddle.to_tensor(inputs.token_types), rows)
    if not len(inputs.logit_rows):
        return None
    return model.compute_logits(paddle.gather(hidden, paddle.to_tensor(inputs.logit_rows)))


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


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model_config
        paddle.seed(config.seed)
        start = time.perf_counter()
        # Tensor parallel: this process is rank 0; the workers load their shards while it loads its own.
        self.workers = WorkerGroup(config) if config.tensor_parallel_size > 1 else None
        self.compiled: CompiledDecoder | None = None  # set once the KV cache exists
        self.vision = VisionCache()
        self.tp = self.workers.tp if self.workers is not None else SINGLE
        ops.share_cores(self.tp.size)
        if self.workers is not None:
            # Stops the workers when this runner is garbage-collected or the interpreter exits.
            self._finalizer = weakref.finalize(self, self.workers.close)
        try:
            self.model = load_model(mc, self.tp, config.quant, dtype=config.dtype,
                                    lm_head_fp32=config.lm_head_fp32)
            ops.keep_freed_memory()  # from now on activations reuse heap memory instead of fresh pages
            self._ask_workers()  # loaded
            logger.info("loaded %s from %s in %.1f s", mc.architectures[0], mc.model_path, time.perf_counter() - start)
            self.sampling = SamplingStage(config.logprobs_mode)
            self.num_blocks = self._num_kv_blocks()
            # All ranks hold the same blocks, each its own heads.
            self._ask_workers(messages.AllocateKV(self.num_blocks))
        except BaseException:
            self.close()
            raise
        self.kv_caches = allocate_kv_caches(mc.num_hidden_layers, self.num_blocks, config.block_size,
                                            kv_heads_per_rank(mc.num_key_value_heads, self.tp.size), mc.head_dim,
                                            config.kv_cache_dtype)
        self.compiled = (CompiledDecoder.build(self.model, self.kv_caches, config.block_size, config.max_model_len)
                         if self.workers is None else None)

    def _ask_workers(self, message: object | None = None) -> list:
        """Send `message` to every worker (if given) and wait for each one's reply."""
        if self.workers is None:
            return []
        if message is not None:
            self.workers.send_all(message)
        return self.workers.receive_all()

    def close(self) -> None:
        """Stop the tensor-parallel workers now (otherwise that happens when the runner is collected)."""
        if self.workers is not None:
            self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids if self.workers is not None else []

    def worker_parameters(self) -> list[dict[str, np.ndarray]]:
        """Each worker rank's parameters (its shard of the model), in rank order; for inspection."""
        return [reply.weights for reply in self._ask_workers(messages.GetParameters())]

    def _kv_block_bytes(self) -> int:
        """Bytes of one KV block over all ranks (they share this host's memory)."""
        mc = self.config.model_config
        heads = kv_heads_per_rank(mc.num_key_value_heads, self.tp.size) * self.tp.size
        row = row_bytes(mc.head_dim, self.config.kv_cache_dtype)
        return 2 * mc.num_hidden_layers * self.config.block_size * heads * row

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            logger.info("total_block_num:%d (num_gpu_blocks_override)", cfg.num_gpu_blocks_override)
            return cfg.num_gpu_blocks_override
        # No GPU: the budget is a share of host memory, less what the ranks hold resident now that the
        # weights are loaded, and an activation reserve; never more than the host still has available.
        share = host_memory_bytes() * cfg.gpu_memory_utilization
        resident = resident_bytes() + sum(resident_bytes(pid) for pid in self.worker_pids)
        reserve = int(share * ACTIVATION_RESERVE)
        budget = min(int(share) - resident, available_memory_bytes()) - reserve
        by_memory = max(budget // self._kv_block_bytes(), 0)
        # More blocks than max_num_seqs full-length requests can use would only sit idle in RAM.
        by_use = cfg.max_num_seqs * cfg.max_blocks_per_seq
        num_blocks = int(min(by_memory, by_use))
        if num_blocks < cfg.max_blocks_per_seq:
            raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves room for {num_blocks} KV "
                             f"blocks, fewer than one max_model_len={cfg.max_model_len} request needs "
                             f"({cfg.max_blocks_per_seq}); raise it or lower max_model_len")
        logger.info("KV cache from host memory: gpu_memory_utilization=%.2f of %.1f GiB allows %d blocks; "
                    "total_block_num:%d (block_size %d, %.1f MiB)", cfg.gpu_memory_utilization,
                    host_memory_bytes() / 2**30, by_memory, num_blocks, cfg.block_size,
                    num_blocks * self._kv_block_bytes() / 2**20)
        return num_blocks

    def execute(self, step: SchedulerOutput, wait_for_masks: Callable[[], object] | None = None) -> ModelRunnerOutput:
        """Forward and sample the step. `wait_for_masks`: returns once step.token_bitmask is filled (the engine
        computes the grammar masks while the forward runs)."""
        batch = self.compiled.covers(step.forward) if self.compiled is not None else None
        if batch is not None:
            how = sample_in_forward(step)
            if how is not None:  # the compiled call takes the tokens while the logits are in cache
                return self.sampling.sampled_in_forward(step, self.compiled.forward_tokens(batch, how.params), how)
            logits = self.compiled.forward(batch)
        else:
            logits = self._layer_forward(step.forward)
        return self.sampling(step, logits, wait_for_masks)

    def _forward(self, inputs: ForwardBatch) -> paddle.Tensor | None:
        """The batch's logits by the compiled step when it covers the batch, else layer by layer."""
        compiled = self.compiled.covers(inputs) if self.compiled is not None else None
        if compiled is not None:
            return self.compiled.forward(compiled)
        return self._layer_forward(inputs)

    def _layer_forward(self, inputs: ForwardBatch) -> paddle.Tensor | None:
        """The batch's logits layer by layer (run_step), on every tensor-parallel rank."""
        if self.workers is None:
            return run_step(self.model, inputs, self.config.block_size, self.kv_caches, self.vision)
        # Every rank runs the same forward; Ctrl-C waits until the step's collectives are done.
        with deferred_sigint():
            self.workers.send_all(messages.Step(inputs))
            try:
                return run_step(self.model, inputs, self.config.block_size, self.kv_caches, self.vision)
            except BaseException as e:
                dead = self.workers.dead_workers(grace_s=0.2)
                self.workers.close(kill=True)  # the others may be waiting in a collective that never comes
                if dead:
                    raise WorkerError(f"tensor-parallel {dead} during a step; create a new LLM") from e
                raise

    def warmup(self) -> None:
        """One forward over a full budget of tokens so the first real step runs at speed."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len,
                self.num_blocks * self.config.block_size)
        self._forward(warmup_inputs(n, self.config.block_size))
