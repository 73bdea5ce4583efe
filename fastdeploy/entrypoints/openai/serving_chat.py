"""POST /v1/chat/completions: whole responses and SSE streams."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from fastdeploy.engine.request import Logprob, Request, RequestOutput
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest
from fastdeploy.entrypoints.openai.serving import (
    SSE_DONE, APIError, ServingContext, gather, make_requests, new_id, now, request_outputs, sampling_params, sse,
    top_entries, usage)


def _token_logprob(token: int, entry: dict[int, Logprob], k: int) -> dict[str, Any]:
    def item(lp: Logprob) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    return {**item(entry[token]), "top_logprobs": [item(lp) for _, lp in top_entries(entry, k)]}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    return {"content": [_token_logprob(t, e, k) for t, e in zip(token_ids, entries)]}


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, http: HTTPRequest) -> Response:
    ctx.check_model(body.model)
    if not body.messages:
        raise APIError(400, "messages must be a non-empty list of {'role', 'content'} objects", "messages")
    params = sampling_params(body.to_sampling_params)
    start = time.time()
    try:
        # Off the event loop: media are fetched and decoded here.
        prompt = await run_in_threadpool(ctx.prompts.from_chat, body.messages, body.chat_template_kwargs,
                                         body.chat_template)
    except (ValueError, TypeError, NotImplementedError, jinja2.TemplateError) as e:
        raise APIError(400, f"messages: {e}", "messages") from None
    thinking = bool((body.chat_template_kwargs or {}).get("enable_thinking", True))
    requests = make_requests(ctx, [prompt], params, start, thinking)
    call_id, created = new_id("chatcmpl"), now()
    k = body.top_logprobs or 0
    if body.stream:
        return StreamingResponse(_stream(ctx, body, requests, call_id, created, k), media_type="text/event-stream")
    choices = await gather(ctx, requests, http)
    response = {
        "id": call_id, "object": "chat.completion", "created": created, "model": ctx.model_name,
        "choices": [{
            "index": i,
            "message": {"role": "assistant", "content": c.text, "reasoning_content": c.reasoning,
                        **_token_ids(body, requests[i], c.token_ids)},
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, k) if body.logprobs else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        } for i, c in enumerate(choices)],
        "usage": usage(requests, body.n),
    }
    return JSONResponse(response)


def _token_ids(body: ChatCompletionRequest, request: Request, completion: list[int]) -> dict[str, Any]:
    if not body.return_token_ids:
        return {}
    return {"prompt_token_ids": request.prompt_token_ids, "completion_token_ids": completion}


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, requests: list[Request], call_id: str,
                  created: int, k: int) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": call_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                    "choices": choices, **extra})

    try:
        for i, request in enumerate(requests):  # the first chunk of each choice carries the role
            delta = {"role": "assistant", "content": ""}
            if body.return_token_ids:
                delta["prompt_token_ids"] = request.prompt_token_ids
            yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
        async for output in request_outputs(ctx, requests):
            choice = _delta_choice(body, output, k)
            if choice is not None:
                yield chunk([choice])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage=usage(requests, body.n))
    except APIError as e:  # the engine failed mid-stream: say so in the stream, then end it
        yield sse({"error": {"message": e.message, "type": "internal_server_error", "code": e.status}})
    yield SSE_DONE


def _delta_choice(body: ChatCompletionRequest, output: RequestOutput, k: int) -> dict[str, Any] | None:
    out = output.outputs
    delta: dict[str, Any] = {}
    if out.reasoning_content:
        delta["reasoning_content"] = out.reasoning_content
    if out.text:
        delta["content"] = out.text
    if body.return_token_ids and out.token_ids:
        delta["completion_token_ids"] = out.token_ids
    logprobs = chat_logprobs(out.token_ids, out.logprobs, k) if body.logprobs and out.token_ids else None
    if not delta and logprobs is None and not output.finished:
        return None  # the step's text is held back (a possible stop string or an unfinished character)
    return {"index": out.index, "delta": delta, "logprobs": logprobs,
            "finish_reason": out.finish_reason if output.finished else None,
            **({"stop_reason": out.stop_reason} if output.finished else {})}
