"""LLMEngine: turns prompts into Requests, steps the scheduler and the runner, and decides when
each request is finished."""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.config import EngineConfig
from fastdeploy.engine.request import (CompletionOutput, Logprob, Request, RequestMetrics, RequestOutput,
                                       RequestStatus)
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.engine.scheduler import Scheduler
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def not_yet_supported(params: SamplingParams) -> str | None:
    """Name the first requested feature this engine cannot do yet."""
    if params.n != 1:
        return "n > 1"
    for name in ("stop", "bad_words", "bad_words_token_ids", "prompt_logprobs", "reasoning_max_tokens"):
        if getattr(params, name) is not None:
            return name
    return None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer, chat_template=config.chat_template)
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        mc = config.model_config
        eos = mc.eos_token_ids or ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = mc.vocab_size
        self._ids = itertools.count()
        if config.use_warmup:
            self.runner.warmup()

    # ---- requests -------------------------------------------------------------------------
    def make_request(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                     index: int, arrival_time: float | None = None) -> Request:
        """A Request; problems with this one request are recorded on it (error_code 400)."""
        number = next(self._ids)
        params = params.with_model_defaults(self.config.model_config.generation_defaults)
        generator = np.random.default_rng(params.seed if params.seed is not None else [self.config.seed, number])
        request = Request(
            request_id=str(number), index=index, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
            params=params, max_tokens=0, eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            generator=generator, metrics=RequestMetrics(arrival_time=arrival_time or time.time()))
        error = self._validate(request)
        if error:
            request.error_code, request.error_msg = 400, error
            request.finish("abort")
            return request
        # As FastDeploy: max_tokens is cut to what fits after the prompt.
        request.max_tokens = min(params.max_tokens or self._room(request), self._room(request))
        return request

    def _room(self, request: Request) -> int:
        """Output tokens that fit after the prompt, in max_model_len and in the whole KV cache."""
        capacity = self.runner.num_blocks * self.config.block_size
        return min(self.config.max_model_len, capacity) - request.num_prompt_tokens

    def _validate(self, request: Request) -> str | None:
        n, params, cfg = request.num_prompt_tokens, request.params, self.config
        unsupported = not_yet_supported(params)
        if unsupported:
            raise NotImplementedError(f"SamplingParams {unsupported} is not supported yet")
        if n == 0:
            return "the prompt is empty: it must have at least one token"
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}"
        if n >= cfg.max_model_len:
            return (f"the prompt has {n} tokens; max_model_len={cfg.max_model_len} leaves no room for output "
                    "(the prompt must be shorter than max_model_len)")
        if self._room(request) < 1:
            return f"the prompt has {n} tokens; the KV cache holds only {self.runner.num_blocks * cfg.block_size}"
        if params.logprobs is not None and cfg.max_logprobs != -1 and (
                params.logprobs == -1 or params.logprobs > cfg.max_logprobs):
            return f"logprobs={params.logprobs} is more than max_logprobs={cfg.max_logprobs}"
        return None

    def add_request(self, request: Request) -> None:
        if not request.is_finished:
            self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduler + model step; return the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch.requests:
            raise RuntimeError("scheduler made no progress: no request fits the KV cache")
        result = self.runner.execute(batch)
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            self.block_manager.cache_full_blocks(request)
            forward = request.metrics.model_forward_time or 0.0
            request.metrics.model_forward_time = forward + result.forward_seconds

        finished = []
        for row, (request, token) in enumerate(result.sampled):
            request.append_token(token)
            if row in result.logprobs:
                self._record_logprobs(request, token, *result.logprobs[row])
            self._check_stop(request, token)
            if request.is_finished:
                self.scheduler.finish(request)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token: int) -> None:
        if request.num_output_tokens >= request.params.min_tokens:
            if token in request.eos_token_ids:
                return request.finish("stop", token)
            if request.params.stop_token_ids and token in request.params.stop_token_ids:
                return request.finish("stop", token)
        if request.num_output_tokens >= request.max_tokens:
            request.finish("length")

    def _record_logprobs(self, request: Request, token: int, top_ids: np.ndarray, top_logprobs: np.ndarray,
                         logprob: float, rank: int) -> None:
        entry = {int(t): Logprob(float(lp), i + 1, self._decode_one(int(t)))
                 for i, (t, lp) in enumerate(zip(top_ids, top_logprobs))}
        if token not in entry:
            entry[token] = Logprob(logprob, rank, self._decode_one(token))
        if request.logprobs is None:
            request.logprobs = []
        request.logprobs.append(entry)

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def abort_all(self) -> None:
        """Drop every queued and running request (e.g. after Ctrl-C), freeing their blocks."""
        for request in list(self.scheduler.running):
            self.scheduler.finish(request)
            request.finish("abort")
        while self.scheduler.waiting:
            self.scheduler.waiting.popleft().finish("abort")

    # ---- outputs --------------------------------------------------------------------------
    def make_output(self, request: Request) -> RequestOutput:
        token_ids = request.output_token_ids
        text = self.tokenizer.decode(token_ids, skip_special_tokens=request.params.skip_special_tokens)
        completion = CompletionOutput(
            index=request.index, send_idx=max(len(token_ids) - 1, 0), token_ids=token_ids, text=text,
            logprobs=request.logprobs, finish_reason=request.finish_reason, stop_reason=request.stop_reason)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=completion, finished=request.status is RequestStatus.FINISHED, metrics=request.metrics,
            num_cached_tokens=request.num_cached_tokens, error_code=request.error_code,
            error_msg=request.error_msg, prompt_logprobs=request.prompt_logprobs)
