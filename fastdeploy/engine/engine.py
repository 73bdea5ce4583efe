"""LLMEngine: turns prompts into Requests, steps the scheduler and the runner, and decides when
each request is finished."""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.config import EngineConfig
from fastdeploy.engine.request import Request, RequestMetrics, RequestOutput
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.engine.scheduler import Scheduler
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.output.output_processor import OutputProcessor
from fastdeploy.reasoning.parsers import THINK_END, get_reasoning_parser
from fastdeploy.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FORCED_THINK_END = "\n" + THINK_END + "\n\n"  # what ends a thinking part cut by reasoning_max_tokens


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer, chat_template=config.chat_template)
        parser = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        self.output_processor = OutputProcessor(self.tokenizer, parser)
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
    def make_request(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, index: int,
                     arrival_time: float | None = None, sample: int = 0, enable_thinking: bool = True,
                     leader: Request | None = None) -> Request:
        """A Request; problems with this one request are recorded on it (error_code 400).
        `sample` numbers the n samples of one prompt; each draws from its own generator."""
        number = next(self._ids)
        params = params.with_model_defaults(self.config.model_config.generation_defaults)
        seed = [params.seed, sample] if params.seed is not None else [self.config.seed, number]
        request = Request(
            request_id=str(number), index=index, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
            params=params, max_tokens=0, eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            generator=np.random.default_rng(seed), metrics=RequestMetrics(arrival_time=arrival_time or time.time()))
        if params.reasoning_max_tokens is not None and self.output_processor.reasoning_parser is None:
            raise ValueError("reasoning_max_tokens needs a thinking model run with reasoning_parser set on the LLM")
        self.output_processor.start(request, enable_thinking)
        error = self._validate(request)
        if error:
            request.error_code, request.error_msg = 400, error
            request.finish("abort")
            return request
        # As FastDeploy: max_tokens is cut to what fits after the prompt.
        request.max_tokens = min(params.max_tokens or self._room(request), self._room(request))
        request.bad_words = self.output_processor.bad_word_sequences(params.bad_words or ())
        request.bad_words += [(t,) for t in params.bad_words_token_ids or ()]
        if self.config.enable_prefix_caching and params.prompt_logprobs is None:
            request.prefix_leader = leader
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        return request

    def _room(self, request: Request) -> int:
        """Output tokens that fit after the prompt, in max_model_len and in the whole KV cache."""
        capacity = self.runner.num_blocks * self.config.block_size
        return min(self.config.max_model_len, capacity) - request.num_prompt_tokens

    def _validate(self, request: Request) -> str | None:
        n, params, cfg = request.num_prompt_tokens, request.params, self.config
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
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and cfg.max_logprobs != -1 and (k == -1 or k > cfg.max_logprobs):
                return f"{name}={k} is more than max_logprobs={cfg.max_logprobs}"
        bad = [t for t in (params.stop_token_ids or []) + (params.bad_words_token_ids or []) if t >= self.vocab_size]
        if bad:
            return f"stop_token_ids and bad_words_token_ids must be < vocab size {self.vocab_size}, got {bad}"
        return None

    def add_request(self, request: Request) -> None:
        if not request.is_finished:
            self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduler + model step; return the requests that got a new token in it."""
        batch = self.scheduler.schedule()
        if not batch.requests:
            raise RuntimeError("scheduler made no progress: no request fits the KV cache")
        result = self.runner.execute(batch)
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            self.block_manager.cache_full_blocks(request)
            forward = request.metrics.model_forward_time or 0.0
            request.metrics.model_forward_time = forward + result.forward_seconds
        processor = self.output_processor
        for request, position, *top in result.prompt_logprobs:
            if len(request.prompt_logprobs) == position + 1:  # not yet recorded (before a preemption)
                request.prompt_logprobs.append(processor.logprob_entry(request.prompt_token_ids[position + 1], *top))

        stepped = []
        for row, (request, token) in enumerate(result.sampled):
            request.append_token(token)
            if row in result.logprobs:
                if request.logprobs is None:
                    request.logprobs = []
                request.logprobs.append(processor.logprob_entry(token, *result.logprobs[row]))
            self._check_stop(request, token)
            processor.on_token(request, token)
            self._limit_reasoning(request)
            if request.is_finished:
                self.scheduler.finish(request)
            stepped.append(request)
        return stepped

    def _check_stop(self, request: Request, token: int) -> None:
        if request.num_output_tokens >= request.params.min_tokens:
            if token in request.eos_token_ids:
                return request.finish("stop", token)
            if request.params.stop_token_ids and token in request.params.stop_token_ids:
                return request.finish("stop", token)
        if request.num_output_tokens >= request.max_tokens:
            request.finish("length")

    def _limit_reasoning(self, request: Request) -> None:
        """After reasoning_max_tokens thinking tokens, force the end of the thinking part."""
        limit = request.params.reasoning_max_tokens
        if limit is None or not request.reasoning or request.is_finished or THINK_END in request.text:
            return
        request.num_reasoning_tokens += 1
        if request.num_reasoning_tokens == limit and not request.forced_tokens:
            request.forced_tokens = self.tokenizer.encode(FORCED_THINK_END, add_special_tokens=False)

    def abort_all(self) -> None:
        """Drop every queued and running request (e.g. after Ctrl-C), freeing their blocks."""
        for request in list(self.scheduler.running):
            self.scheduler.finish(request)
            request.finish("abort")
        while self.scheduler.waiting:
            self.scheduler.waiting.popleft().finish("abort")

    def make_output(self, request: Request, delta: bool = False) -> RequestOutput:
        return self.output_processor.make_output(request, delta)
