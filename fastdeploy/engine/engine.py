"""LLMEngine: turns prompts into Requests and steps them: scheduler -> runner -> scheduler update ->
output processor -> each request's outputs to its caller's sink.

Its doors (submission.py): `make_submission` (one prompt's requests, checked), `submit` (queue them, with
the sink their outputs go to), `abort` / `cancel`, `fail_all`, `waiting`, `stats`, `step`. The Request
records never leave it. `submit` and `abort` may be called from any thread while another steps; they take
effect at the next step boundary. Steps are serialised by a lock, so several threads may step the same
engine (e.g. concurrent LLM.generate calls); outputs are made and handed to the sinks inside it."""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque

import numpy as np

from fastdeploy.config import EngineConfig
from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.output_processor import OutputProcessor
from fastdeploy.engine.request import Request, request_error
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.engine.scheduler import Scheduler
from fastdeploy.engine.step_builder import ScheduledStep
from fastdeploy.engine.structured_output import StructuredOutputManager
from fastdeploy.engine.submission import EngineStats, RankedGroup, Route, Sink, Submission
from fastdeploy.guided.matcher import GuidedDecoding
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.model_executor.multimodal import MultimodalInputs
from fastdeploy.outputs import RequestMetrics, RequestOutput
from fastdeploy.reasoning.parsers import get_reasoning_parser
from fastdeploy.speculative import MtpDrafter, NgramDrafter
from fastdeploy.step_types import ModelRunnerOutput
from fastdeploy.tool_parsers.parsers import ToolParser, get_tool_parser
from fastdeploy.worker.launched_group import serve_steps
from fastdeploy.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _emitted_rows(step: ScheduledStep) -> set[int] | None:
    """The sampling rows whose tokens were emitted, when a request drafted in the step (else all were)."""
    if len(step.rows) == len(step.samplers):
        return None
    rows, first = set(), 0
    for request, emitted in zip(step.samplers, step.emitted):
        rows.update(range(first, first + len(emitted)))
        while first < len(step.rows) and step.rows[first] is request:  # its rows are consecutive
            first += 1
    return rows


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.launch is not None and config.launch.rank > 0:
            serve_steps(config)  # never returns: this process serves rank 0's steps, then exits
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer, chat_template=config.chat_template)
        parser = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        tools = get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None
        self.output_processor = OutputProcessor(self.tokenizer, parser, tools)
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.kv_cache_ratio,
                                   speculative=config.speculative is not None)
        mc = config.model_config
        eos = mc.eos_token_ids or ([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = mc.vocab_size
        self.structured_output = StructuredOutputManager(GuidedDecoding(
            self.tokenizer, mc.vocab_size, self.eos_token_ids, config.guided_decoding_backend,
            config.guided_decoding_disable_any_whitespace))
        self._ids = itertools.count()
        # Filled from any thread, drained by the stepping thread (deque appends and pops are atomic).
        self._incoming: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._routes: dict[str, Route] = {}  # submitted requests by id: where their outputs go
        self._batch_size = 0  # requests in the last step
        self._step_lock = threading.Lock()
        if config.use_warmup:
            self.runner.warmup()

    # ---- doors ----------------------------------------------------------------------------
    def make_submission(self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                        first_index: int, start: float, enable_thinking: bool = True,
                        mm: MultimodalInputs | None = None, error: str | None = None,
                        tool_calls: bool | ToolParser = False, cache_salt: str | None = None) -> Submission:
        """One prompt's requests, made and checked (see make_requests), not yet queued: submit() or discard()
        it. Accepted or rejected as a whole (`Submission.error`)."""
        requests = self.make_requests(prompt, prompt_token_ids, params, first_index, start, enable_thinking, mm,
                                      error, tool_calls, cache_salt)
        rejected = next((r for r in requests if r.error_code != 200), None)
        for request in requests if rejected is not None else ():
            if not request.is_finished:
                request.error_code, request.error_msg = rejected.error_code, rejected.error_msg
                request.finish("abort")
        return Submission(requests, first_index)

    def submit(self, submissions: list[Submission], sink: Sink, stream: bool = False) -> None:
        """Queue the submissions' requests (from any thread). Their outputs go to `sink`, called inside the
        step that made them: with `stream`, a delta each step a request advanced; else its whole output once
        it finished, a best_of prompt's candidates all together, best first (outputs.index = the prompt's
        first index + rank). A rejected prompt's outputs go at once."""
        for submission in submissions:
            requests = submission.requests
            group = RankedGroup(len(requests), submission.first_index) \
                if not stream and requests[0].params.ranks_candidates else None
            for request in requests:  # routed before it is queued: the stepping thread may take it at once
                self._routes[request.request_id] = Route(request, sink, stream, group)
            for request in requests:
                if request.is_finished:
                    with self._step_lock:
                        self._deliver(request)
                else:
                    self._incoming.append(request)

    def discard(self, submissions: list[Submission]) -> None:
        """Drop submissions that will not be submitted (their text state)."""
        for submission in submissions:
            for request in submission.requests:
                self.output_processor.release(request.request_id)

    def abort(self, request_ids: list[str]) -> None:
        """Abort queued or running requests (from any thread): at the next step boundary each finishes
        with finish_reason "abort", its blocks freed, and its final output goes to its sink. Finished or
        unknown ids are ignored."""
        self._aborts.extend(request_ids)

    def cancel(self, request_ids: list[str]) -> None:
        """Abort these requests at once, for a caller that will not read their outputs (after Ctrl-C, an
        error, a dropped stream): no output is made; blocks and text state are freed now."""
        routes = [self._routes.pop(i, None) for i in request_ids]
        self.abort_now([route.request for route in routes if route is not None])

    def fail_all(self, message: str) -> None:
        """Finish every queued and running request with error 500 and `message` (after a step that failed
        as a whole: its batch's state is unknown); each one's final output goes to its sink."""
        with self._step_lock:
            requests = self._take_inbox() + list(self.scheduler.requests.values())
            for request in requests:
                request.error_code, request.error_msg = 500, message
                self.scheduler.finish_request(request, "abort")
                self._deliver(request)

    def waiting(self, request_ids: list[str]) -> bool:
        """Whether any of these requests is still waiting to be scheduled for the first time."""
        routes = [self._routes.get(i) for i in request_ids]
        return any(r is not None and r.request.metrics.inference_start_time is None and not r.request.is_finished
                   for r in routes)

    @property
    def parses_tool_calls(self) -> bool:
        """Whether outputs of requests made with tool_calls=True get their calls parsed (a tool_call_parser)."""
        return self.output_processor.tool_parser is not None

    def stats(self) -> EngineStats:
        blocks, scheduler = self.block_manager, self.scheduler
        total = len(blocks.blocks)
        return EngineStats(len(scheduler.running), len(scheduler.waiting), 1.0 - blocks.num_free_blocks / max(total, 1),
                           scheduler.num_preemptions, total, blocks.num_free_blocks, blocks.num_cached_free,
                           self._batch_size, self.config.max_num_seqs)

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
        reasoning = self.output_processor.start(request, prompt, index, enable_thinking, tool_calls)
        bad_words = self.output_processor.bad_word_sequences(params.bad_words or ())
        error = error or request_error(request, self.config, self.vocab_size, self._room(request), bad_words)
        if not error and params.guided_decoding is not None:
            error = self.structured_output.attach(request, reasoning)
        if error:
            request.error_code, request.error_msg = 400, error
            request.finish("abort")
            return request
        # As FastDeploy: max_tokens is cut to what fits after the prompt.
        request.max_tokens = min(params.max_tokens or self._room(request), self._room(request))
        request.bad_words = bad_words + [(t,) for t in params.bad_words_token_ids or ()]
        if self.config.enable_prefix_caching and params.prompt_logprobs is None:
            request.prefix_leader = leader
        request.drafter = self._drafter(request)
        return request

    def _drafter(self, request: Request) -> NgramDrafter | MtpDrafter | None:
        """The request's draft source under speculative_config. A grammar's requests draft what it allows
        (DraftPacing.draft), each row masked after the drafts before it; drafts past a reasoning limit are taken
        back where the output processor forces the end of thinking; a multimodal request's drafts follow its
        prompt, so they take text positions (step_inputs.chunk_inputs)."""
        spec = self.config.speculative
        if spec is None:
            return None
        return MtpDrafter(spec) if self.config.drafts_with_mtp else NgramDrafter(spec)

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

    def add_request(self, request: Request) -> None:
        """Queue a request without a route (tests and benchmarks stepping by hand make its outputs with
        make_output); a request rejected by make_request is already finished."""
        if not request.is_finished:
            self._incoming.append(request)

    def has_unfinished(self) -> bool:
        return bool(self._incoming) or self.scheduler.has_unfinished()

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> None:
        """Run one scheduler + model step and hand the submitted requests' outputs to their sinks."""
        with self._step_lock:
            for request in self._step():
                self._deliver(request)

    def _step(self) -> list[Request]:
        """The step; the requests that got a new token in it or were aborted before it."""
        aborted = self._take_inbox()
        step = self.scheduler.schedule()
        self._batch_size = len(step.requests)
        if not step.requests:
            if aborted or not self.scheduler.has_unfinished():
                return aborted
            raise RuntimeError("scheduler made no progress: no request fits the KV cache")
        grammars = any(r.grammar is not None for r in step.samplers)  # else the manager has nothing to do
        # The grammar masks are computed on the mask worker while the forward runs.
        masks = self.structured_output.start_masks(step) if grammars else None
        try:
            output = self.runner.execute(step.model_input, masks.wait if masks else None)
        finally:
            if masks is not None:
                masks.wait()  # the matchers are not touched again before their masks are done
        stepped = self.scheduler.update_from_output(step, output)
        if grammars:
            self.structured_output.advance(self.scheduler, step.samplers,
                                    lambda request, e: self._fail_request(request, e, "guided decoding"))
        thinking_over = self._process_text(step, output)
        if grammars:
            self.structured_output.activate_after_reasoning(thinking_over)
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

    def _process_text(self, step: ScheduledStep, output: ModelRunnerOutput) -> list[Request]:
        """Decode the step's tokens (stop strings, forced end of thinking, logprob entries); the requests whose
        thinking part has ended."""
        processor = self.output_processor
        tokens = output.sampled_token_ids
        thinking_over: list[Request] = []
        for (request, position), top in zip(step.prompt_rows, output.prompt_logprobs):
            try:
                processor.add_prompt_logprobs(request, position, top)
            except Exception as e:  # noqa: BLE001 - fails this request only (see _fail_request)
                self._fail_request(request, e, "prompt logprobs")
        emitted_rows = _emitted_rows(step)
        for j, top in zip(step.model_input.logprob_rows.tolist(), output.logprobs):
            request = step.rows[j]
            if emitted_rows is not None and j not in emitted_rows:
                continue  # a draft's row past the first rejected one: its token was never emitted
            request.cumulative_logprob += top.target_logprob
            if request.params.logprobs is not None and request.error_code < 500:
                try:
                    processor.add_logprobs(request, tokens[j], top)
                except Exception as e:  # noqa: BLE001
                    self._fail_request(request, e, "logprobs")
        for request, emitted, draft_tops in zip(step.samplers, step.emitted, step.draft_logprobs):
            for i, token in enumerate(emitted):
                if request.error_code >= 500:
                    break
                if i < len(draft_tops):  # an accepted MTP draft, its logprobs asked for
                    processor.add_draft_logprobs(request, request.num_output_tokens - len(emitted) + i, token,
                                                 draft_tops[i])
                try:
                    events = processor.on_token(request, token)
                except Exception as e:  # noqa: BLE001 - detokenizer, stop strings, reasoning
                    self._fail_request(request, e, "decoding")
                    break
                if events.stop_string is not None:
                    self.scheduler.finish_request(request, "stop", events.stop_string)
                if events.forced_tokens:
                    request.forced_tokens = events.forced_tokens
                if events.thinking_over:
                    thinking_over.append(request)
                if events.stop_string is not None or events.forced_tokens:
                    # Tokens a draft brought past a stop string or the end of thinking were never produced.
                    self.scheduler.take_back(request, len(emitted) - i - 1)
                    break
        return thinking_over

    def _fail_request(self, request: Request, error: BaseException, stage: str) -> None:
        """A bug or a pathological output in one request's text side finishes that request alone (error 500,
        blocks freed) so the batch goes on; its next output is the error. Holds the step lock."""
        logger.error("request %s failed in %s; finishing it alone", request.request_id, stage, exc_info=error)
        request.error_code = 500
        request.error_msg = f"internal error in this request's {stage}: {type(error).__name__}"
        if not request.is_finished:
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

    def make_output(self, request: Request, delta: bool = False) -> RequestOutput:
        """The request's output (see OutputProcessor.make_output), for a caller stepping by hand (tests)."""
        with self._step_lock:
            return self._output(request, delta)

    def _output(self, request: Request, delta: bool) -> RequestOutput:
        """make_output with the step lock held: a request failed by its text side gets an output carrying its
        error_code 500 instead, and one whose make_output itself raises is failed so."""
        if request.error_code < 500:
            try:
                output = self.output_processor.make_output(request, delta)
            except Exception as e:  # noqa: BLE001 - reasoning / tool-call parsing of this request's text
                self._fail_request(request, e, "output parsing")
            else:
                if request.mm is not None:
                    output.num_input_image_tokens = request.mm.num_image_tokens
                    output.num_input_video_tokens = request.mm.num_video_tokens
                return output
        return self.output_processor.failed_output(request)

    def _deliver(self, request: Request) -> None:
        """Hand a stepped request's output to its sink, as its route says (step lock held). A request added
        without a route (stepped by hand) is left to its caller."""
        route = self._routes.get(request.request_id)
        if route is None or not (route.stream or request.is_finished):
            return
        output = self._output(request, delta=route.stream)
        if request.is_finished:
            del self._routes[request.request_id]
        for out in route.group.add(request, output) if route.group is not None else [output]:
            try:
                route.sink(out)
            except Exception as e:  # noqa: BLE001 - the caller's sink: this request ends with an error, the rest go on
                self._fail_request(request, e, "delivery")
                self._routes.pop(request.request_id, None)
                try:
                    route.sink(self.output_processor.failed_output(request))
                except Exception:  # noqa: BLE001
                    logger.exception("the sink of request %s failed again; its caller gets nothing more",
                                     request.request_id)
