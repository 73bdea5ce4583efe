"""ModelRunner: owns the model and the KV cache, and turns a scheduled batch into sampled tokens.

A step's tokens are flattened into one ragged batch (no padding): token ids, positions, and the
forward context that maps them onto the paged cache. Only requests whose known tokens are all
computed after this step get logits and a sampled token; a mid-prompt chunk gets neither.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import numpy as np
import paddle

from fastdeploy import ops
from fastdeploy.engine.config import EngineConfig
from fastdeploy.engine.request import Request
from fastdeploy.engine.scheduler import ScheduledBatch
from fastdeploy.distributed.parallel_state import SINGLE, kv_heads_per_rank
from fastdeploy.model_executor.forward_context import allocate_kv_caches
from fastdeploy.model_executor.layers.sampler import Sampler, SamplingBatch
from fastdeploy.model_executor.load import load_model
from fastdeploy.model_executor.memory_plan import available_memory_bytes, host_memory_bytes, resident_bytes
from fastdeploy.worker.step import StepInputs, run_step, warmup_inputs
from fastdeploy.worker.worker_group import WorkerError, WorkerGroup, deferred_sigint

logger = logging.getLogger(__name__)

ACTIVATION_RESERVE = 0.1  # share of the memory budget kept for activations


TopLogprobs = tuple[np.ndarray, np.ndarray, float, int]  # top ids, their logprobs, target logprob, target rank


@dataclass(slots=True)
class StepResult:
    sampled: list[tuple[Request, int]]  # requests that got a new token this step
    logprobs: dict[int, TopLogprobs]  # index into `sampled` -> logprobs of that token
    prompt_logprobs: list[tuple[Request, int, np.ndarray, np.ndarray, float, int]]  # (request, position, *top)
    forward_seconds: float


def top_logprobs(logp: np.ndarray, k: int, target: int) -> TopLogprobs:
    """The k best entries of one row of log-probabilities (k=-1: all), and the target's logprob and rank."""
    vocab = logp.shape[-1]
    k = vocab if k == -1 else min(k, vocab)
    top = np.argpartition(-logp, k - 1)[:k] if 0 < k < vocab else np.arange(k)
    top = top[np.argsort(-logp[top], kind="stable")]
    rank = int((logp > logp[target]).sum()) + 1
    return top, logp[top], float(logp[target]), rank


def banned_tokens(request: Request) -> list[int]:
    """Ids the request must not produce next: EOS and stop ids before min_tokens, and the last
    token of every bad-word sequence whose other tokens end the output."""
    banned = []
    if request.num_output_tokens < request.params.min_tokens:
        banned.extend(request.eos_token_ids)
        banned.extend(request.params.stop_token_ids or ())
    if request.bad_words:
        output = request.output_token_ids
        for seq in request.bad_words:
            if len(seq) == 1 or (len(seq) - 1 <= len(output) and tuple(output[len(output) - len(seq) + 1:]) == seq[:-1]):
                banned.append(seq[-1])
    return banned


def with_logit_bias(logits: paddle.Tensor, requests: list[Request]) -> paddle.Tensor | np.ndarray:
    """The sampler's input: logits plus each request's logit_bias (before penalties, as vLLM does);
    the raw logits stay untouched for logprobs."""
    biases = [r.params.logit_bias for r in requests]
    if not any(biases):
        return logits
    biased = np.array(logits.numpy(), copy=True)
    for row, bias in enumerate(biases):
        if bias:
            biased[row, list(bias)] += np.asarray(list(bias.values()), dtype=biased.dtype)
    return biased


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model_config
        paddle.seed(config.seed)
        start = time.perf_counter()
        # Tensor parallel: this process is rank 0; the workers load their shards while it loads its own.
        self.workers = WorkerGroup(config) if config.tensor_parallel_size > 1 else None
        self.tp = self.workers.tp if self.workers is not None else SINGLE
        ops.share_cores(self.tp.size)
        if self.workers is not None:
            # Stops the workers when this runner is garbage-collected or the interpreter exits.
            self._finalizer = weakref.finalize(self, self.workers.close)
        try:
            self.model = load_model(mc, self.tp, config.quantization)
            ops.keep_freed_memory()  # from now on activations reuse heap memory instead of fresh pages
            self._ask_workers()  # loaded
            logger.info("loaded %s from %s in %.1f s", mc.architectures[0], mc.model_path, time.perf_counter() - start)
            self.sampler = Sampler()
            self.num_blocks = self._num_kv_blocks()
            self._ask_workers(("kv", self.num_blocks))  # all ranks hold the same blocks, each its own heads
        except BaseException:
            self.close()
            raise
        self.kv_caches = allocate_kv_caches(mc.num_hidden_layers, self.num_blocks, config.block_size,
                                            kv_heads_per_rank(mc.num_key_value_heads, self.tp.size), mc.head_dim)

    def _ask_workers(self, message: tuple | None = None) -> list:
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
        return self._ask_workers(("parameters",))

    def _kv_block_bytes(self) -> int:
        """Bytes of one KV block over all ranks (they share this host's memory)."""
        mc = self.config.model_config
        heads = kv_heads_per_rank(mc.num_key_value_heads, self.tp.size) * self.tp.size
        return 2 * mc.num_hidden_layers * self.config.block_size * heads * mc.head_dim * 4

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

    @paddle.no_grad()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        start = time.perf_counter()
        requests, counts = batch.requests, batch.num_new_tokens
        ids, positions, context_lens = [], [], []
        for request, n in zip(requests, counts):
            begin = request.num_computed_tokens
            ids.extend(request.token_ids[begin:begin + n])
            positions.extend(range(begin, begin + n))
            context_lens.append(begin + n)

        # Rows that finish their known tokens this step produce the next token; prompt rows of
        # requests asking for prompt_logprobs get logits too.
        offsets = np.cumsum([0] + list(counts))
        sampling = [i for i, (r, c) in enumerate(zip(requests, context_lens)) if c == r.num_tokens]
        prompt_rows = [(r, p, int(offsets[i]) + p - r.num_computed_tokens)
                       for i, r in enumerate(requests) if r.params.prompt_logprobs is not None
                       for p in range(r.num_computed_tokens, min(context_lens[i], r.num_prompt_tokens - 1))]
        rows = [int(offsets[i + 1]) - 1 for i in sampling] + [row for _, _, row in prompt_rows]
        logits = self._forward(StepInputs(
            np.asarray(ids, dtype=np.int64), np.asarray(positions, dtype=np.int64), list(counts), context_lens,
            [r.block_table for r in requests], np.asarray(rows, dtype=np.int64)))
        if logits is None:
            return StepResult([], {}, [], time.perf_counter() - start)
        chosen = [requests[i] for i in sampling]
        tokens: list[int] = []
        if chosen:
            tokens = self.sampler(with_logit_bias(logits[:len(chosen)], chosen), self._sampling_batch(chosen)).tolist()
            for j, r in enumerate(chosen):
                if r.forced_tokens:
                    tokens[j] = r.forced_tokens.pop(0)
        logprob_rows = [j for j, r in enumerate(chosen) if r.params.logprobs is not None]
        result = StepResult(list(zip(chosen, tokens)), {}, [], 0.0)
        if logprob_rows or prompt_rows:
            # Raw log-softmax of the model's logits (before penalties and temperature).
            logp = paddle.nn.functional.log_softmax(logits, axis=-1).numpy()
            for j in logprob_rows:
                result.logprobs[j] = top_logprobs(logp[j], chosen[j].params.logprobs, tokens[j])
            for j, (r, p, _) in enumerate(prompt_rows, start=len(chosen)):
                result.prompt_logprobs.append(
                    (r, p, *top_logprobs(logp[j], r.params.prompt_logprobs, r.prompt_token_ids[p + 1])))
        result.forward_seconds = time.perf_counter() - start
        return result

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        def column(name: str, dtype: type) -> np.ndarray:
            return np.array([getattr(r.params, name) for r in requests], dtype=dtype)

        return SamplingBatch(
            temperature=column("temperature", np.float32),
            top_p=column("top_p", np.float32),
            top_k=column("top_k", np.int64),
            min_p=column("min_p", np.float32),
            repetition_penalty=column("repetition_penalty", np.float32),
            frequency_penalty=column("frequency_penalty", np.float32),
            presence_penalty=column("presence_penalty", np.float32),
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            banned_token_ids=[banned_tokens(r) for r in requests],
            generators=[r.generator for r in requests],
        )

    def _forward(self, inputs: StepInputs) -> paddle.Tensor | None:
        if self.workers is None:
            return run_step(self.model, inputs, self.config.block_size, self.kv_caches)
        # Every rank runs the same forward; Ctrl-C waits until the step's collectives are done.
        with deferred_sigint():
            self.workers.send_all(("step", inputs))
            try:
                return run_step(self.model, inputs, self.config.block_size, self.kv_caches)
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
