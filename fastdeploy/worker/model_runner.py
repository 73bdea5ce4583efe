"""ModelRunner: owns the model and the KV cache, and turns a step's SchedulerOutput (plain arrays) into
a ModelRunnerOutput: sampled token ids and the logprobs asked for. It never sees a request.

The step's tokens are one ragged batch (no padding); only the rows the engine marked get logits: the
requests that catch up with their known tokens this step sample one token, and prompt rows of
requests that asked for prompt logprobs give those. `execute` asks fastdeploy/sampling/policy.py whether the
compiled step may take the tokens inside its forward call; otherwise it forwards the step and hands the
logits to the sampling stage (fastdeploy/sampling/sampler.py).
"""
from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import numpy as np
import paddle

from fastdeploy import ops
from fastdeploy.config import EngineConfig
from fastdeploy.distributed.parallel_state import SINGLE
from fastdeploy.sampling.policy import sample_in_forward, sampled_in_forward
from fastdeploy.sampling.sampler import SamplingStage
from fastdeploy.step_types import ForwardBatch, ModelRunnerOutput, SchedulerOutput
from fastdeploy.worker import messages
from fastdeploy.worker.compiled_step import CompiledDecoder
from fastdeploy.worker.forward import (VisionCache, load_shard, rank_kv_caches, run_step, run_step_keeping,
                                      warmup_inputs)
from fastdeploy.worker.kv_plan import kv_block_bytes, num_kv_blocks
from fastdeploy.worker.launched_group import LaunchedGroup
from fastdeploy.worker.mtp_proposer import MtpLayer, MtpProposer
from fastdeploy.worker.worker_group import WorkerGroup

logger = logging.getLogger(__name__)


def _start_workers(config: EngineConfig) -> WorkerGroup | LaunchedGroup | None:
    """The other tensor-parallel ranks: those Paddle's launcher started (config.launch), or workers this process
    starts on this host; None for one rank."""
    if config.tensor_parallel_size == 1:
        return None
    return LaunchedGroup(config) if config.launch is not None else WorkerGroup(config)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model_config
        paddle.seed(config.seed)
        start = time.perf_counter()
        # Tensor parallel: this process is rank 0; the other ranks load their shards while it loads its own.
        self.workers = _start_workers(config)
        self.compiled: CompiledDecoder | None = None  # set once the KV cache exists
        self.vision = VisionCache()
        self.tp = self.workers.tp if self.workers is not None else SINGLE
        ranks_here = self.workers.ranks_here if self.workers is not None else 1
        ops.share_cores(ranks_here)  # this host's cores, shared by its ranks
        if self.workers is not None:
            # Stops the workers when this runner is garbage-collected or the interpreter exits.
            self._finalizer = weakref.finalize(self, self.workers.close)
        try:
            self.model = load_shard(config, self.tp)
            if self.workers is not None:
                self.workers.wait_loaded()
            logger.info("loaded %s from %s in %.1f s", mc.architectures[0], mc.model_path, time.perf_counter() - start)
            self.sampling = SamplingStage(config.logprobs_mode)
            self.num_blocks = num_kv_blocks(config, self.tp.size, ranks_here, self.worker_pids)
            if self.workers is not None:  # all ranks hold the same blocks, each its own heads
                self.num_blocks = self.workers.allocate_kv(self.num_blocks)
        except BaseException:
            self.close()
            raise
        self.kv_caches = rank_kv_caches(config, self.num_blocks, self.tp.size)
        main_caches = self.kv_caches[:mc.num_hidden_layers]  # the MTP layer's, if any, come after
        self.compiled = (CompiledDecoder.build(self.model, main_caches, config.block_size, config.max_model_len)
                         if self.workers is None else None)
        self.mtp = self._mtp_proposer() if config.drafts_with_mtp else None

    def _mtp_proposer(self) -> MtpProposer:
        """The MTP layer's drafter, on the compiled step when it covers the layer (its own cache, the last)."""
        compiled = CompiledDecoder.build(self.model, self.kv_caches[-1:], self.config.block_size,
                                         self.config.max_model_len, mtp=True) if self.workers is None else None
        return MtpProposer(MtpLayer(self.model, self.kv_caches, self.config.block_size, compiled), self.workers)

    def close(self) -> None:
        """Stop the tensor-parallel workers now (otherwise that happens when the runner is collected)."""
        if self.workers is not None:
            self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids if self.workers is not None else []

    def worker_parameters(self) -> list[dict[str, np.ndarray]]:
        """Each worker rank's parameters (its shard of the model), in rank order; for inspection."""
        return self.workers.parameters() if self.workers is not None else []

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block over all ranks."""
        return kv_block_bytes(self.config, self.tp.size)

    def execute(self, step: SchedulerOutput, wait_for_masks: Callable[[], object] | None = None) -> ModelRunnerOutput:
        """Forward and sample the step. `wait_for_masks`: returns once step.token_bitmask is filled (the engine
        computes the grammar masks while the forward runs)."""
        batch = self.compiled.covers(step.forward) if self.compiled is not None else None
        hidden = None
        if batch is not None:
            how = sample_in_forward(step, self.compiled.vocab)
            if how is not None:  # the compiled call takes the tokens while the logits are in cache
                output = sampled_in_forward(step, self.compiled.forward_tokens(batch, how), how)
            else:
                output = self.sampling(step, self.compiled.forward(batch), wait_for_masks)
            if step.mtp is not None:
                hidden = self.compiled.hidden
        elif step.mtp is not None:  # every rank keeps its hidden states for the MTP layer's runs
            def forward() -> tuple[paddle.Tensor | None, np.ndarray]:
                return run_step_keeping(self.model, step.forward, self.config.block_size, self.kv_caches, self.vision)
            logits, hidden = forward() if self.workers is None else \
                self.workers.run_step(messages.Step(step.forward), forward)
            output = self.sampling(step, logits, wait_for_masks)
        else:
            output = self.sampling(step, self._layer_forward(step.forward), wait_for_masks)
        if step.mtp is not None:
            output.draft_token_ids, output.draft_logprobs = self.mtp.propose(step, output.sampled_token_ids, hidden)
        return output

    def _forward(self, inputs: ForwardBatch) -> paddle.Tensor | None:
        """The batch's logits by the compiled step when it covers the batch, else layer by layer."""
        compiled = self.compiled.covers(inputs) if self.compiled is not None else None
        if compiled is not None:
            return self.compiled.forward(compiled)
        return self._layer_forward(inputs)

    def _layer_forward(self, inputs: ForwardBatch) -> paddle.Tensor | None:
        """The batch's logits layer by layer (run_step), on every tensor-parallel rank."""
        def forward() -> paddle.Tensor | None:
            return run_step(self.model, inputs, self.config.block_size, self.kv_caches, self.vision)
        return forward() if self.workers is None else self.workers.run_step(messages.Step(inputs), forward)

    def warmup(self) -> None:
        """One forward over a full budget of tokens so the first real step runs at speed."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len,
                self.num_blocks * self.config.block_size)
        self._forward(warmup_inputs(n, self.config.block_size))
