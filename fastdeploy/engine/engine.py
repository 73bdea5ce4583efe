"""LLMEngine: turns prompts into Requests and steps them: scheduler -> runner -> scheduler update ->
output processor. `add_request` and `abort_request` may be called from any thread while another
steps; they take effect at the next step boundary. Steps themselves are serialised by a lock, so
several threads may step the same engine (e.g. concurrent LLM.generate calls)."""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque

import numpy as np

from fastdeploy.engine import guided_requests
from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.config import EngineConfig
from fastdeploy.engine.request import Request, RequestMetrics, RequestOutput
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.engine.scheduler import Scheduler
from fastdeploy.engine.step_builder import ScheduledStep
from fastdeploy.input.ernie4_5_vl_processor import MultimodalInputs
from fastdeploy.guided.matcher import GuidedDecoding
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.output.output_processor import OutputProcessor
from fastdeploy.reasoning.parsers import get_reasoning_parser
from fastdeploy.tool_parsers.parsers import ToolParser, get_tool_parser
from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.step_types import ModelRunnerOutput

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer, chat_template=config.chat_template)
        parser = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        tools = get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None
        self.output_processor = OutputProcessor(self.tokenizer, parser, tools)
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        mc = config.model_config
        eos = mc.eos_token_ids or ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = mc.vocab_size
        self.guided = GuidedDecoding(self.tokenizer, mc.vocab_size, self.eos_token_ids, config.guided_decoding_backend,
                                     config.guided_decoding_disable_any_whitespace)
        self._ids = itertools.count()
        # Filled from any thread, drained by the stepping thread (deque appends and pops are atomic).
        self._incoming: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._step_lock = threading.Lock()
        if config.use_warmup:
            self.runner.warmup()

    # ---- requests -------------------------------------------------------------------------
    def make_request(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, index: int,
                     arrival_time: float | None = None, sample: int = 0, enable_thinking: bool = True,
                     leader: Request | None = None, mm: MultimodalInputs | None = None,
                     error: str | None = None, tool_calls: bool | ToolParser = False,
                     cache_salt: str | None = None) -> Request:
        """A Request; problems with this one request are recorded on it (error_code 400), as is `error`
        (what went wrong preparing its prompt, e.g. unreadable media). `sample` numbers the n samples of
        one prompt; each draws from its own generator. tool_calls: parse tool calls from the output (a chat
        given tools) with the engine's tool_call_parser, or with the parser given. cache_salt: only requests
        with the same salt share prefix-cache blocks."""
        number = next(self._ids)
        params = params.with_model_defaults(self.config.model_config.generation_defaults)
        seed = [params.seed, sample] if params.seed is not None else [self.config.seed, number]
        arrival = arrival_time or time.time()
        request = Request(  # uuid4 ids, as FastDeploy's LLM: unique across engines and processes
            request_id=str(uuid.uuid4()), prompt_token_ids=list(prompt_token_ids), params=params, max_tokens=0,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            generator=np.random.default_rng(seed), mm=mm, cache_salt=cache_salt,
            metrics=RequestMetrics(arrival_time=arrival, request_start_time=arrival))
        if params.reasoning_max_tokens is not None and self.output_processor.reasoning_parser is None:
            raise ValueError("reasoning_max_tokens needs a thinking model run with reasoning_parser set on the LLM")
        self.output_processor.start(request, prompt, index, enable_thinking, tool_calls)
        error = error or self._validate(request) or guided_requests.attach_grammar(self.guided, self.output_processor,
                                                                                   request)
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
        return request

    def make_requests(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, first_index: int,
                      start: float, enable_thinking: bool = True, mm: MultimodalInputs | None = None,
                      error: str | None = None, tool_calls: bool | ToolParser = False,
                      cache_salt: str | None = None) -> list[Request]:
        """The params.n samples of one prompt (params.best_of candidates when set; indices first_index...);
        later ones reuse the first one's cached prompt. `start`: when the prompt arrived, before preprocessing
        (time.time()): their arrival_time, as FastDeploy's."""
        requests: list[Request] = []
        preprocess_cost = time.time() - start
        for sample in range(params.num_candidates):
            request = self.make_request(prompt, prompt_token_ids, params, first_index + sample, arrival_time=start,
                                        sample=sample, enable_thinking=enable_thinking,
                                        leader=requests[0] if requests else None, mm=mm, error=error,
                                        tool_calls=tool_calls, cache_salt=cache_salt)
            request.metrics.preprocess_cost_time = preprocess_cost
            requests.append(request)
        return requests

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
        vl = cfg.model_config.multimodal
        if vl is not None and request.mm is None and {vl.tokens.image, vl.tokens.video} & set(request.prompt_token_ids):
            return ("the prompt holds image/video placeholder token ids but no media; pass the images/videos with "
                    "the prompt text (multimodal_data, or content parts in chat)")
        if n >= cfg.max_model_len:
            return (f"the prompt has {n} tokens; max_model_len={cfg.max_model_len} leaves no room for output "
                    "(the prompt must be shorter than max_model_len)")
        if self._room(request) < 1:
            return f"the prompt has {n} tokens; the KV cache holds only {self.runner.num_blocks * cfg.block_size}"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and cfg.max_logprobs != -1 and (k == -1 or k > cfg.max_logprobs):
                return f"{name}={k} is more than max_logprobs={cfg.max_logprobs}"
        if cfg.logprobs_mode != "raw_logprobs" and (params.temp_scaled_logprobs or params.top_p_normalized_logprobs):
            return (f"temp_scaled_logprobs / top_p_normalized_logprobs transform raw logprobs; this engine reports "
                    f"logprobs_mode={cfg.logprobs_mode!r} (they need 'raw_logprobs')")
        ids = (params.stop_token_ids or []) + (params.bad_words_token_ids or []) + list(params.logit_bias)
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            return (f"stop_token_ids, bad_words_token_ids and logit_bias keys must be < vocab size {self.vocab_size}, "
                    f"got {bad}")
        return self._bans_everything(request)

    def _bans_everything(self, request: Request) -> str | None:
        """Why no token could ever be sampled, if the request's bans can cover the whole vocabulary (a step
        with every logit at -inf raises in the sampler, or a greedy row picks a banned id). Bad-word
        sequences sharing a prefix ban their last tokens together once it is output: counted as if it may be."""
        params = request.params
        always = set(params.bad_words_token_ids or ())
        after: dict[tuple[int, ...], set[int]] = {}
        for seq in self.output_processor.bad_word_sequences(params.bad_words or ()):
            (always if len(seq) == 1 else after.setdefault(seq[:-1], set())).add(seq[-1])
        if params.min_tokens > 0:  # EOS and stop ids are banned until min_tokens outputs
            always |= set(request.eos_token_ids) | set(params.stop_token_ids or ())
        worst = always | max(after.values(), key=lambda s: len(s - always), default=set())
        if sum(0 <= t < self.vocab_size for t in worst) >= self.vocab_size:
            return (f"bad_words_token_ids, bad_words and (below min_tokens={params.min_tokens}) stop_token_ids and "
                    f"EOS together ban all {self.vocab_size} tokens of the vocabulary: nothing could be sampled")
        return None

    def add_request(self, request: Request) -> None:
        """Queue a request (from any thread); a request rejected by make_request is already finished."""
        if not request.is_finished:
            self._incoming.append(request)

    def abort_request(self, request_id: str) -> None:
        """Abort a queued or running request (from any thread): at the next step boundary it finishes
        with finish_reason "abort", its blocks freed, and that step returns it."""
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._incoming) or self.scheduler.has_unfinished()

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduler + model step; return the requests that got a new token in it or were
        aborted before it."""
        with self._step_lock:
            aborted = self._take_inbox()
            step = self.scheduler.schedule()
            if not step.requests:
                if aborted or not self.scheduler.has_unfinished():
                    return aborted
                raise RuntimeError("scheduler made no progress: no request fits the KV cache")
            masks = guided_requests.start_masks(self.guided, step)  # computed while the forward runs
            try:
                output = self.runner.execute(step.model_input, masks.wait if masks else None)
            finally:
                if masks is not None:
                    masks.wait()  # the matchers are not touched again before their masks are done
            stepped = self.scheduler.update_from_output(step, output)
            guided_requests.advance(self.scheduler, step.samplers,
                                    lambda request, e: self._fail_request(request, e, "guided decoding"))
            self._process_text(step, output)
            guided_requests.activate_after_reasoning(self.output_processor, step.samplers)
            return aborted + stepped

    def _take_inbox(self) -> list[Request]:
        while self._incoming:
            self.scheduler.add(self._incoming.popleft())
        aborted = []
        while self._aborts:
            request = self.scheduler.requests.get(self._aborts.popleft())
            if request is not None:
                self.scheduler.finish_request(request, "abort")
                aborted.append(request)
        return aborted

    def _process_text(self, step: ScheduledStep, output: ModelRunnerOutput) -> None:
        processor = self.output_processor
        tokens = output.sampled_token_ids
        for (request, position), top in zip(step.prompt_rows, output.prompt_logprobs):
            try:
                processor.add_prompt_logprobs(request, position, top)
            except Exception as e:  # noqa: BLE001 - fails this request only (see _fail_request)
                self._fail_request(request, e, "prompt logprobs")
        for j, top in zip(step.model_input.logprob_rows.tolist(), output.logprobs):
            request = step.samplers[j]
            request.cumulative_logprob += top.target_logprob
            if request.params.logprobs is not None and request.error_code < 500:
                try:
                    processor.add_logprobs(request, tokens[j], top)
                except Exception as e:  # noqa: BLE001
                    self._fail_request(request, e, "logprobs")
        for request, token in zip(step.samplers, tokens):
            if request.error_code >= 500:
                continue
            try:
                events = processor.on_token(request, token)
            except Exception as e:  # noqa: BLE001 - detokenizer, stop strings, reasoning
                self._fail_request(request, e, "decoding")
                continue
            if events.stop_string is not None:
                self.scheduler.finish_request(request, "stop", events.stop_string)
            if events.forced_tokens:
                request.forced_tokens = events.forced_tokens

    def _fail_request(self, request: Request, error: BaseException, stage: str) -> None:
        """A bug or a pathological output in one request's text side finishes that request alone (error 500,
        blocks freed) so the batch goes on; its next make_output is the error. Holds the step lock or is
        called on the stepping thread's make_output (which takes it)."""
        logger.error("request %s failed in %s; finishing it alone", request.request_id, stage, exc_info=error)
        request.error_code = 500
        request.error_msg = f"internal error in this request's {stage}: {type(error).__name__}"
        self.scheduler.finish_request(request, "abort")

    def abort_now(self, requests: list[Request]) -> None:
        """Abort these requests at once (after a step another thread is running) and drop their text
        state: for a caller that will not read their outputs (after Ctrl-C, an error, a dropped stream)."""
        for request in requests:
            self._aborts.append(request.request_id)
        with self._step_lock:
            self._take_inbox()
        for request in requests:
            self.output_processor.release(request.request_id)

    def abort_all(self) -> list[Request]:
        """Abort every queued and running request at once and drop their text state (after a failed step,
        whose batch state is unknown); the requests aborted."""
        with self._step_lock:
            requests = self._take_inbox() + list(self.scheduler.requests.values())
            for request in requests:
                self.scheduler.finish_request(request, "abort")
        for request in requests:
            self.output_processor.release(request.request_id)
        return requests

    def make_output(self, request: Request, delta: bool = False) -> RequestOutput:
        """The request's output (see OutputProcessor.make_output); a request failed by its text side gets an
        output carrying its error_code 500 instead, and one whose make_output itself raises is failed so."""
        if request.error_code < 500:
            try:
                output = self.output_processor.make_output(request, delta)
            except Exception as e:  # noqa: BLE001 - reasoning / tool-call parsing of this request's text
                with self._step_lock:  # the scheduler is the stepping threads' (LLM steps from several)
                    self._fail_request(request, e, "output parsing")
            else:
                if request.mm is not None:
                    output.num_input_image_tokens = request.mm.num_image_tokens
                    output.num_input_video_tokens = request.mm.num_video_tokens
                return output
        return self.output_processor.failed_output(request)


def best_candidates(candidates: list[Request]) -> list[Request]:
    """The params.n of one prompt's candidates to return: with best_of > n the n with the highest
    cumulative logprob (sum of their sampled tokens' logprobs), best first, as vLLM ranks them."""
    params = candidates[0].params
    if not params.ranks_candidates:
        return candidates
    ranked = sorted(candidates, key=lambda r: r.cumulative_logprob, reverse=True)
    return ranked[:params.n]
