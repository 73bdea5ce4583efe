"""What the chat and completion endpoints share: errors in OpenAI's shape, turning a request body into
engine requests, waiting for their outputs (aborting them when the client goes away), SSE framing,
usage and per-choice accumulation."""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.engine.submission import Submission
from fastdeploy.entrypoints.multimodal import MultimodalPrompts
from fastdeploy.entrypoints.prompts import Prepared, TextPrompts
from fastdeploy.entrypoints.openai.engine_loop import EngineLoop
from fastdeploy.outputs import Logprob, RequestOutput
from fastdeploy.tool_parsers.parsers import ToolParser

# Under --max-waiting-time a call checks this often whether the engine loop (another thread) has scheduled
# its requests; a poll, because a scheduled request need not produce output in that step (chunked prefill).
_SCHEDULED_POLL_S = 0.01


class APIError(Exception):
    """Answered as OpenAI's error object with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True)
class RequestLimits:
    """What one API call may ask for (the server's --max-* flags); past one is a 400 naming the field, before
    any work. n / best_of: each sample is an engine request built on the event loop and a seat in the batch;
    16 covers best-of-n use while one call cannot fill the batch. Stop strings and bad words: each is matched
    against every output step, so their count and length bound that work; generous next to OpenAI's 4 stops."""

    max_n: int = 16
    max_stop_strings: int = 16  # stop strings, and bad words, per request
    max_stop_string_chars: int = 512
    max_prompts: int = 256  # prompts of one /v1/completions call

    def check(self, body: Any) -> None:
        for name in ("n", "best_of"):
            value = getattr(body, name, None)
            if value is not None and value > self.max_n:
                raise APIError(400, f"{name} ({value}) is over this server's --max-n={self.max_n}", name)
        for name in ("stop", "bad_words"):
            strings = getattr(body, name, None)
            strings = [strings] if isinstance(strings, str) else strings or []
            if len(strings) > self.max_stop_strings:
                raise APIError(400, f"{name} has {len(strings)} strings, over this server's "
                                    f"--max-stop-strings={self.max_stop_strings}", name)
            if any(len(s) > self.max_stop_string_chars for s in strings):
                raise APIError(400, f"{name}: a string is longer than this server's "
                                    f"--max-stop-string-chars={self.max_stop_string_chars}", name)


@dataclass
class ServingContext:
    engine: LLMEngine
    loop: EngineLoop
    prompts: TextPrompts | MultimodalPrompts  # how chat messages become token ids (and media inputs)
    model_name: str
    max_concurrency: int | None = None
    max_waiting_time: float | None = None  # seconds a request may wait for a seat (None: no limit)
    trust_request_chat_template: bool = False  # --trust-request-chat-template: requests may send templates
    # --enable-prompt-tokens-details: usage reports prefix-cache hits, which tell a client whether anyone
    # sent the same prompt prefix before; off by default.
    prompt_tokens_details: bool = False
    in_flight: int = 0  # API calls being served (touched only on the event loop)
    # Other names a request may use (the --model argument as typed: clients that send it keep working).
    accepted_names: tuple[str, ...] = ()
    limits: RequestLimits = field(default_factory=RequestLimits)

    def check_model(self, name: str | None) -> None:
        """The request names a model this server serves (404 if not); called first by each endpoint."""
        if name is not None and name != self.model_name and name not in self.accepted_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           "model")

    def admit(self) -> None:
        if self.loop.failed:
            raise APIError(503, f"the server cannot serve requests: {self.loop.failed}")
        if self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            raise APIError(429, f"the server is at --max-concurrency={self.max_concurrency}; retry later")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


def sampling_params(make: Callable[[], SamplingParams]) -> SamplingParams:
    try:
        return make()
    except (ValueError, TypeError) as e:  # the messages start with the parameter's name
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), name if name.isidentifier() else None) from None


async def make_submissions(ctx: ServingContext, prompts: Sequence[Prepared], params: SamplingParams,
                           start: float, enable_thinking: bool = True, tool_calls: bool | ToolParser = False,
                           cache_salt: str | None = None) -> list[Submission]:
    """The engine's submissions of one API call (one per prompt, its n samples indexed prompt by prompt),
    made on a worker thread (guided decoding compiles its grammars there), off the event loop. A prompt the
    engine rejects (too long, ids out of range, ...) fails the whole call with its message. tool_calls: parse
    tool calls from the outputs."""
    def make() -> list[Submission]:
        made: list[Submission] = []
        try:
            for text, ids, mm in prompts:
                made.append(ctx.engine.make_submission(text, ids, params, sum(map(len, made)), start,
                                                       enable_thinking, mm, tool_calls=tool_calls,
                                                       cache_salt=cache_salt))
        except (ValueError, TypeError) as e:
            ctx.engine.discard(made)
            raise APIError(400, str(e)) from None
        return made

    # Shielded: the thread runs on if the call is cancelled, and its requests' text state must then be dropped.
    task = asyncio.ensure_future(run_in_threadpool(make))
    try:
        made = await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda f: f.cancelled() or f.exception() or ctx.engine.discard(f.result()))
        raise
    rejected = next((m.error for m in made if m.error is not None), None)
    if rejected is not None:
        ctx.engine.discard(made)
        raise APIError(*rejected)
    return made


def request_ids(submissions: Sequence[Submission]) -> list[str]:
    return [i for submission in submissions for i in submission.request_ids]


async def client_gone(http: HTTPRequest) -> None:
    """Returns once the HTTP client has disconnected. The endpoint has read the whole body, so uvicorn's
    receive() has nothing more to say until the client leaves (or the response is complete)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def submit(ctx: ServingContext, submissions: list[Submission], http: HTTPRequest, stream: bool
                 ) -> asyncio.Queue:
    """Queue the prompts of one API call for the engine; the queue their outputs arrive on (stream: deltas,
    else whole outputs, see EngineLoop.submit). With --max-waiting-time, first wait until the engine has
    scheduled each request: if one is still waiting for a seat in the running batch after that many seconds,
    all are aborted and the call fails with HTTP 408 (FastDeploy's status for it), before a stream's response
    starts. A client that leaves meanwhile has its requests aborted (the call then ends with 499, which nobody
    reads)."""
    queue = ctx.loop.submit(submissions, stream)
    if ctx.max_waiting_time is None:
        return queue
    ids = request_ids(submissions)
    deadline = time.monotonic() + ctx.max_waiting_time
    gone = asyncio.ensure_future(client_gone(http))
    try:
        # A failed engine schedules nothing: request_outputs then reports the failure (500), not a timeout.
        while not ctx.loop.failed and ctx.engine.waiting(ids):
            left = deadline - time.monotonic()
            if gone.done():
                raise APIError(499, "the client disconnected")
            if left <= 0:
                raise APIError(408, f"the request waited more than --max-waiting-time={ctx.max_waiting_time:g} s "
                                    f"for a seat in the running batch (--max-num-seqs="
                                    f"{ctx.engine.config.max_num_seqs}); retry later")
            await asyncio.sleep(min(left, _SCHEDULED_POLL_S))
    except BaseException:  # timed out, the client left, or the call was cancelled while waiting
        ctx.loop.abort(ids)
        raise
    finally:
        gone.cancel()
    return queue


async def request_outputs(ctx: ServingContext, submissions: list[Submission], queue: asyncio.Queue,
                          http: HTTPRequest | None = None) -> AsyncIterator[RequestOutput]:
    """Every output of the submitted requests (`queue`: what submit() returned) until all are finished.
    If the caller stops listening (a streaming client went away: the task is cancelled) or `http`'s client
    disconnects (noticed at once, while outputs flow too), the unfinished requests are aborted and their KV
    blocks freed at the next step."""
    remaining = sum(map(len, submissions))
    gone = asyncio.ensure_future(client_gone(http)) if http is not None else None
    try:
        while remaining:
            output = await _next_output(queue, gone)
            if output is None:
                raise APIError(499, "the client disconnected")  # nobody reads it
            remaining -= output.finished
            if output.error_code >= 500:  # failed in the engine: this request alone, or its whole step
                raise APIError(output.error_code, output.error_msg or "internal error")
            yield output
    finally:
        if gone is not None:
            gone.cancel()
        if remaining:
            ctx.loop.abort(request_ids(submissions))


async def _next_output(queue: asyncio.Queue, gone: asyncio.Future | None) -> Any:
    """The next item on the queue, or None if `gone` (the client's disconnect) comes first."""
    if gone is None or not queue.empty():
        return await queue.get()
    get = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
        return get.result() if get.done() else None
    finally:
        get.cancel()  # asyncio.Queue.get gives up its place without losing an item


class EventStream(StreamingResponse):
    """An SSE response that aborts its call's unfinished requests and runs `on_close` (the server's slot
    release) when it ends, however it ends: done, its client gone mid-stream, or gone before the first byte
    (Starlette then cancels the body before it starts, so a `finally` inside the body would never run)."""

    def __init__(self, body: AsyncIterator[str], ctx: ServingContext, submissions: Sequence[Submission]):
        super().__init__(body, media_type="text/event-stream")
        self.on_close: list[Callable[[], None]] = [lambda: ctx.loop.abort(request_ids(submissions))]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for close in self.on_close:
                close()


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass(slots=True)
class Tally:
    """What OpenAI's usage needs of a call's outputs, counted as they arrive (a stream keeps nothing else)."""

    completion_tokens: int = 0
    cached_tokens: dict[int, int] = field(default_factory=dict)  # output index -> its prompt's cache hits

    def add(self, output: RequestOutput) -> None:
        self.completion_tokens += len(output.outputs.token_ids)
        self.cached_tokens[output.outputs.index] = output.num_cached_tokens


def usage(ctx: ServingContext, submissions: Sequence[Submission], tally: Tally) -> dict[str, Any]:
    """OpenAI's usage: prompt tokens counted once per prompt (not per sample), every sample's output (best_of
    candidates not returned included, as OpenAI bills them), and the prefix-cache hits if the server reports
    them."""
    prompt = sum(len(s.prompt_token_ids) for s in submissions)
    counts: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": tally.completion_tokens,
                              "total_tokens": prompt + tally.completion_tokens}
    if ctx.prompt_tokens_details:  # one sample per prompt gives its prompt's hits
        counts["prompt_tokens_details"] = {
            "cached_tokens": sum(tally.cached_tokens.get(s.first_index, 0) for s in submissions)}
    return counts


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token the grammar disallowed) as -9999.0, as vLLM's server sends it."""
    return -9999.0 if value == -math.inf else value


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k best of one position's logprob entry, best first (the entry may add the sampled token)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                  key=lambda item: item[1].rank)[:k]


@dataclass
class Choice:
    """One choice's output gathered from its deltas."""

    text: str = ""
    reasoning: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    draft_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)  # per token (MTP drafts)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tool_call_deltas: list[dict[str, Any]] = field(default_factory=list)

    def add(self, output: RequestOutput) -> None:
        out = output.outputs
        self.text += out.text or ""
        self.tool_call_deltas += out.tool_calls or []
        if out.reasoning_content is not None:
            self.reasoning = (self.reasoning or "") + out.reasoning_content
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.draft_logprobs is not None:
            self.draft_logprobs += [None] * (len(self.token_ids) - len(out.token_ids) - len(self.draft_logprobs))
            self.draft_logprobs += out.draft_logprobs
        if output.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


def draft_field(body: Any, token_ids: list[int], entries: list[dict[int, Logprob] | None] | None, k: int,
                build: Callable[[list[int], list, int], dict[str, Any]]) -> dict[str, Any]:
    """FastDeploy's `draft_logprobs` (built like `logprobs` by `build`) when the request asked for them
    (include_draft_logprobs) and some tokens were accepted MTP drafts; else nothing."""
    if not body.include_draft_logprobs or not entries or all(e is None for e in entries):
        return {}
    return {"draft_logprobs": build(token_ids, entries, k)}


async def gather(ctx: ServingContext, submissions: list[Submission], queue: asyncio.Queue, http: HTTPRequest
                 ) -> tuple[list[Choice], Tally]:
    """Every request's whole output, by index (a best_of prompt's candidates best first), and the call's tally;
    the requests are aborted the moment `http`'s client disconnects."""
    choices, tally = [Choice() for _ in range(sum(map(len, submissions)))], Tally()
    async for output in request_outputs(ctx, submissions, queue, http):
        choices[output.outputs.index].add(output)
        tally.add(output)
    return choices, tally
