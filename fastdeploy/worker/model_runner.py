"""ModelRunner: owns the model and the KV cache, and turns a step's SchedulerOutput (plain arrays) into
a ModelRunnerOutput: sampled token ids and the logprobs asked for. It never sees a request.

The step's tokens are one ragged batch (no padding); only the rows the engine marked get logits: the
requests that catch up with their known tokens this step sample one token, and prompt rows of
requests that asked for prompt logprobs give those.
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
from fastdeploy.ops.sampling import Sampler, param_table
from fastdeploy.ops.sampling_reference import processed_logits
from fastdeploy.ops.token_bitmask import apply_token_bitmask_, logits_view
from fastdeploy.worker import messages
from fastdeploy.worker.compiled_step import CompiledDecoder
from fastdeploy.step_types import ForwardBatch, ModelRunnerOutput, SchedulerOutput, TopLogprobs, VisionSlice
from fastdeploy.worker.worker_group import WorkerError, WorkerGroup, deferred_sigint

logger = logging.getLogger(__name__)

ACTIVATION_RESERVE = 0.1  # share of the memory budget kept for activations


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Rows of log-probabilities in the logits' dtype, exact down to -inf (a token the grammar disallows).
    Not Paddle's CPU log_softmax: that one floors every value at about -64."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(shifted.dtype)


def top_logprobs(logp: np.ndarray, k: int, target: int) -> TopLogprobs:
    """The k best entries of one row of log-probabilities (k=-1: all), and the target's logprob and rank."""
    vocab = logp.shape[-1]
    k = vocab if k == -1 else min(k, vocab)
    top = np.argpartition(-logp, k - 1)[:k] if 0 < k < vocab else np.arange(k)
    top = top[np.argsort(-logp[top], kind="stable")]
    rank = int((logp > logp[target]).sum()) + 1
    return TopLogprobs(top, logp[top], float(logp[target]), rank)


def transformed_logprobs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """One row's log-probabilities as FastDeploy's temp_scaled_logprobs / top_p_normalized_logprobs give
    them: logits divided by temperature, then (top_p < 1) the distribution cut to its top_p nucleus (the
    tokens whose better-ranked mass is <= top_p) and renormalised. Tokens outside get the float32 minimum,
    as FastDeploy clips them."""
    logp = log_softmax(logits.astype(np.float64) / temperature)
    if top_p < 1.0:
        order = np.argsort(-logp, kind="stable")
        probs = np.exp(logp[order])
        keep = order[(np.cumsum(probs) - probs) <= top_p]
        kept = np.full_like(logp, -np.inf)
        kept[keep] = log_softmax(logp[keep])
        logp = kept
    return np.maximum(logp, np.finfo(np.float32).min).astype(np.float32)


def with_logit_bias(logits: paddle.Tensor, step: SchedulerOutput) -> paddle.Tensor | np.ndarray:
    """The sampler's input: logits plus each row's logit_bias (before penalties, as vLLM does); the raw
    logits stay untouched for logprobs."""
    if not len(step.bias_rows):
        return logits
    biased = np.array(logits.numpy(), copy=True)
    biased[step.bias_rows, step.bias_token_ids] += step.bias_values
    return biased


def with_forced_tokens(tokens: list[int], step: SchedulerOutput) -> list[int]:
    """The sampled tokens with the forced ones put in their rows."""
    if not len(step.forced_token_ids):
        return tokens
    return [f if f >= 0 else t for f, t in zip(step.forced_token_ids.tolist(), tokens)]


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
            self.sampler = Sampler()
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
        tokens = self._compiled_tokens(step)
        if tokens is not None:
            return ModelRunnerOutput(with_forced_tokens(tokens, step))
        logits = self._forward(step.forward)
        num_samples = step.num_samples
        tokens: list[int] = []
        if len(step.guided_rows):
            if wait_for_masks is not None:
                wait_for_masks()
            apply_token_bitmask_(logits, step.guided_rows, step.token_bitmask)
        sampled_from, thresholds = None, None
        if num_samples:
            sampled_from = with_logit_bias(logits[:num_samples], step)
            if self.config.logprobs_mode.startswith("processed") and len(step.logprob_rows):
                thresholds = np.empty(num_samples, dtype=np.float32)
            tokens = with_forced_tokens(self.sampler(sampled_from, step.sampling, thresholds).tolist(), step)
        output = ModelRunnerOutput(tokens)
        if len(step.logprob_rows) or len(step.prompt_logprob_k):
            output.logprobs, output.prompt_logprobs = self._logprobs(step, logits, sampled_from, thresholds, tokens)
        return output

    def _logprobs(self, step: SchedulerOutput, logits: paddle.Tensor, sampled_from: paddle.Tensor | np.ndarray | None,
                  thresholds: np.ndarray | None, tokens: list[int]) -> tuple[list[TopLogprobs], list[TopLogprobs]]:
        """The entries of the sampling rows asking for logprobs and of the prompt rows, as logprobs_mode says:
        raw (the model's logits; a grammar's mask included, as in vLLM) or, for sampling rows, processed (what
        the sampler drew from: `sampled_from` with bans, penalties, temperature and the rows' `thresholds`);
        prompt rows are always raw (nothing processes a prompt position)."""
        raw = logits_view(logits)  # no copy
        if thresholds is not None:
            sample = processed_logits(logits_view(sampled_from), step.sampling, step.logprob_rows, thresholds)
        else:
            sample = raw[step.logprob_rows]
        prompt = raw[step.num_samples + np.arange(len(step.prompt_logprob_k))]
        if self.config.logprobs_mode.endswith("logprobs"):
            sample, prompt = log_softmax(sample), log_softmax(prompt)
        for i, (j, t, p) in enumerate(zip(step.logprob_rows, step.logprob_temperature, step.logprob_top_p)):
            if t != 1.0 or p < 1.0:  # temp_scaled_logprobs / top_p_normalized_logprobs (raw_logprobs only)
                sample[i] = transformed_logprobs(raw[j], float(t), float(p))
        return ([top_logprobs(sample[i], int(k), int(tokens[j]))
                 for i, (j, k) in enumerate(zip(step.logprob_rows, step.logprob_k))],
                [top_logprobs(prompt[i], int(k), int(target))
                 for i, (k, target) in enumerate(zip(step.prompt_logprob_k, step.prompt_logprob_targets))])

    def _compiled_tokens(self, step: SchedulerOutput) -> list[int] | None:
        """The step's sampled tokens when the compiled step runs it and takes them inside the forward call
        (while the logits are in cache): every row samples from its logits with its policy alone (nothing
        banned or penalised) and nothing else needs the logits (logprobs, logit bias, grammar); None
        otherwise."""
        sampling = step.sampling
        if (self.compiled is None or not step.num_samples or len(step.forward.logit_rows) != step.num_samples
                or len(step.guided_rows) or len(step.bias_rows) or len(step.logprob_rows)
                or not sampling.untouched_logits()):
            return None
        batch = self.compiled.covers(step.forward)
        if batch is None:
            return None
        if sampling.plain_greedy():
            return self.compiled.forward_tokens(batch)
        tokens = self.compiled.forward_tokens(batch, param_table(sampling, sampling.greedy_mask()))
        if -1 in tokens:
            raise ValueError(f"logits of row {tokens.index(-1)} are all -inf or hold NaN/inf")
        return tokens

    def _forward(self, inputs: ForwardBatch) -> paddle.Tensor | None:
        compiled = self.compiled.covers(inputs) if self.compiled is not None else None
        if compiled is not None:
            return self.compiled.forward(compiled)
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
