"""POST /v1/chat/completions: whole responses and SSE streams."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from fastdeploy.engine.sampling_params import GuidedDecodingParams, SamplingParams
from fastdeploy.engine.submission import Submission
from fastdeploy.entrypoints.openai.extras import (ChunkGroups, check_raw_chat, raw_chat_prompt, response_id,
                                                  skips_template)
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy.entrypoints.openai.serving import (
    SSE_DONE, APIError, Choice, EventStream, ServingContext, Tally, draft_field, gather, json_logprob,
    make_submissions, now, request_outputs, sampling_params, sse, submit, top_entries, usage)
from fastdeploy.input.chat_template import RequestTemplate
from fastdeploy.outputs import Logprob, RequestOutput
from fastdeploy.tool_parsers import check_tool_choice, check_tools, join_call_deltas, known_tool_parsers
from fastdeploy.tool_parsers.forced import forced_call_parser, forced_call_schema
from fastdeploy.tool_parsers.parsers import ToolParser


def _token_logprob(token: int, entry: dict[int, Logprob], k: int) -> dict[str, Any]:
    def item(lp: Logprob) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}

    return {**item(entry[token]), "top_logprobs": [item(lp) for _, lp in top_entries(entry, k)]}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int) -> dict[str, Any]:
    """OpenAI's chat logprobs of the tokens with an entry (draft logprobs have one for accepted drafts only)."""
    return {"content": [_token_logprob(t, e, k) for t, e in zip(token_ids, entries) if e is not None]}


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, http: HTTPRequest) -> Response:
    ctx.check_model(body.model)
    ctx.limits.check(body)
    raw = skips_template(body)
    if raw:
        check_raw_chat(body)
    elif not body.messages:
        raise APIError(400, "messages must be a non-empty list of {'role', 'content'} objects (or give "
                            "prompt_token_ids)", "messages")
    params = sampling_params(body.to_sampling_params)
    tools, parse_calls, params = _tools(ctx, body, params)
    # A call forced to a named function finishes with "stop" (as OpenAI); other calls with "tool_calls".
    calls_finish = not isinstance(body.tool_choice, dict)
    template_kwargs, template, template_field = _request_template(ctx, body)
    start = time.time()
    try:
        # Off the event loop: media are fetched and decoded here.
        prompt = await run_in_threadpool(raw_chat_prompt, ctx, body) if raw else await run_in_threadpool(
            ctx.prompts.from_chat, body.messages, template_kwargs, template, tools)
    except (ValueError, TypeError, NotImplementedError, jinja2.TemplateError) as e:
        # With a client's template, a rendering failure is most likely the template's.
        field = template_field or "messages"
        raise APIError(400, f"{field}: {e}", field) from None
    thinking = bool((body.chat_template_kwargs or {}).get("enable_thinking", True))
    submissions = await make_submissions(ctx, [prompt], params, start, thinking, tool_calls=parse_calls,
                                         cache_salt=body.cache_salt)
    call_id, created = response_id("chatcmpl", body.request_id), now()
    k = body.top_logprobs or 0
    queue = await submit(ctx, submissions, http, stream=True)  # deltas: a whole response joins them
    if body.stream:
        return EventStream(_stream(ctx, body, submissions, queue, call_id, created, k, calls_finish), ctx,
                           submissions)
    choices, tally = await gather(ctx, submissions, queue, http)
    return JSONResponse(chat_response(body, call_id, created, ctx.model_name, choices,
                                      submissions[0].prompt_token_ids, usage(ctx, submissions, tally), calls_finish))


def chat_response(body: ChatCompletionRequest, call_id: str, created: int, model: str, choices: list[Choice],
                  prompt_ids: list[int], usage: dict[str, Any], calls_finish: bool = True) -> dict[str, Any]:
    """A whole chat.completion body (the server's, and `fastdeploy run-batch`'s)."""
    k = body.top_logprobs or 0
    return {
        "id": call_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": i,
            "message": {"role": "assistant", **_answer(c), "reasoning_content": c.reasoning,
                        **_token_ids(body, prompt_ids, c.token_ids)},
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, k) if body.logprobs else None,
            **(draft_field(body, c.token_ids, c.draft_logprobs, k, chat_logprobs) if body.logprobs else {}),
            "finish_reason": "tool_calls" if c.tool_call_deltas and calls_finish else c.finish_reason,
            "stop_reason": c.stop_reason,
        } for i, c in enumerate(choices)],
        "usage": usage,
    }


def _request_template(ctx: ServingContext, body: ChatCompletionRequest
                      ) -> tuple[dict[str, Any] | None, RequestTemplate | None, str | None]:
    """(the template keywords without a template, the request's template, the field it came in): a client's
    template is refused unless the server trusts them, and is only ever Jinja text (a file path is read
    as the text of the path, not as the file)."""
    kwargs = dict(body.chat_template_kwargs) if body.chat_template_kwargs is not None else None
    sent = [(name, value) for name, value in (("chat_template", body.chat_template),
                                              ("chat_template_kwargs.chat_template",
                                               (kwargs or {}).pop("chat_template", None)))
            if value is not None]
    if not sent:
        return kwargs, None, None
    field, text = sent[-1]  # the keywords' one wins, as offline
    if not ctx.trust_request_chat_template:
        raise APIError(400, f"{field}: this server does not accept chat templates from requests (the operator "
                            "may allow them with --trust-request-chat-template)", field)
    if not isinstance(text, str):
        raise APIError(400, f"{field}: must be a Jinja template string, got {type(text).__name__}", field)
    return kwargs, RequestTemplate(text), field


def _tools(ctx: ServingContext, body: ChatCompletionRequest, params: SamplingParams
           ) -> tuple[list[dict[str, Any]] | None, bool | ToolParser, SamplingParams]:
    """(the tools for the template, whether to parse tool calls from the output or the parser of forced
    calls, the params: for forced calls constrained to the calls' JSON schema)."""
    try:
        tools = check_tools(body.tools)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), "tools") from None
    try:
        choice = check_tool_choice(body.tool_choice, tools)
    except ValueError as e:
        raise APIError(400, str(e), "tool_choice") from None
    if choice == "none":
        return tools, False, params  # the model sees the tools but its answer is taken as text (as vLLM)
    if choice != "auto":  # "required" or a named function: the output is constrained to the call(s)
        if params.guided_decoding is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with "
                                "response_format or guided_* constraints", "tool_choice")
        try:
            guided = GuidedDecodingParams(json=forced_call_schema(choice, tools))
        except ValueError as e:
            raise APIError(400, f"the tools' parameters are not a usable JSON schema: {e}", "tools") from None
        return tools, forced_call_parser(choice), dataclasses.replace(params, guided_decoding=guided)
    if not ctx.engine.parses_tool_calls:
        raise APIError(400, "tool_choice='auto' needs the server started with --tool-call-parser (one of "
                            f"{known_tool_parsers()})", "tool_choice")
    return tools, True, params


def _answer(choice: Choice) -> dict[str, Any]:
    """The message's content and tool calls (content null when the answer is only calls, as OpenAI)."""
    if not choice.tool_call_deltas:
        return {"content": choice.text}
    return {"content": choice.text or None, "tool_calls": join_call_deltas(choice.tool_call_deltas)}


def _token_ids(body: ChatCompletionRequest, prompt_ids: list[int], completion: list[int]) -> dict[str, Any]:
    if not body.return_token_ids:
        return {}
    return {"prompt_token_ids": prompt_ids, "completion_token_ids": completion}


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, submissions: list[Submission],
                  queue: asyncio.Queue, call_id: str, created: int, k: int, calls_finish: bool) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": call_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                    "choices": choices, **extra})

    try:
        tally = Tally()
        for i in range(body.n):  # the first chunk of each choice carries the role
            delta = {"role": "assistant", "content": ""}
            if body.return_token_ids:
                delta["prompt_token_ids"] = submissions[0].prompt_token_ids
            yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
        called: set[int] = set()  # choices that made tool calls
        groups = ChunkGroups(body.max_streaming_response_tokens)
        async for output in request_outputs(ctx, submissions, queue):
            tally.add(output)
            choice = _delta_choice(body, output, k, called, calls_finish)
            for part in _one_call_item_each(choice):
                if (ready := groups.add(part, output.finished)) is not None:
                    yield chunk(ready)
        if (ready := groups.rest()) is not None:
            yield chunk(ready)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage=usage(ctx, submissions, tally))
    except APIError as e:  # the engine failed mid-stream: say so in the stream, then end it
        yield sse({"error": {"message": e.message, "type": "internal_server_error", "code": e.status}})
    yield SSE_DONE


def _delta_choice(body: ChatCompletionRequest, output: RequestOutput, k: int, called: set[int],
                  calls_finish: bool) -> dict[str, Any] | None:
    out = output.outputs
    delta: dict[str, Any] = {}
    if out.reasoning_content:
        delta["reasoning_content"] = out.reasoning_content
    if out.text:
        delta["content"] = out.text
    if out.tool_calls:
        delta["tool_calls"] = out.tool_calls
        called.add(out.index)
    if body.return_token_ids and out.token_ids:
        delta["completion_token_ids"] = out.token_ids
    logprobs = chat_logprobs(out.token_ids, out.logprobs, k) if body.logprobs and out.token_ids else None
    if not delta and logprobs is None and not output.finished:
        return None  # the step's text is held back (a possible stop string or an unfinished character)
    finish = ("tool_calls" if out.index in called and calls_finish else out.finish_reason) if output.finished \
        else None
    drafts = draft_field(body, out.token_ids, out.draft_logprobs, k, chat_logprobs) if body.logprobs else {}
    return {"index": out.index, "delta": delta, "logprobs": logprobs, **drafts, "finish_reason": finish,
            **({"stop_reason": out.stop_reason} if output.finished else {})}


def _one_call_item_each(choice: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A choice delta as chunks holding at most one tool-call delta item each (as OpenAI streams them: the
    call's id and name, then its arguments); the text goes with the first, the finish reason with the last."""
    if choice is None:
        return []
    items = choice["delta"].pop("tool_calls", None)
    if not items:
        return [choice]
    first = {key: value for key, value in choice.items() if key != "stop_reason"}
    first.update(delta={**choice["delta"], "tool_calls": [items[0]]}, finish_reason=None)
    rest = [{"index": choice["index"], "delta": {"tool_calls": [item]}, "logprobs": None, "finish_reason": None}
            for item in items[1:]]
    parts = [first, *rest]
    parts[-1] = {**parts[-1], "finish_reason": choice["finish_reason"]}
    if "stop_reason" in choice:
        parts[-1]["stop_reason"] = choice["stop_reason"]
    return parts
