"""POST /v1/completions: whole responses and SSE streams, one or several prompts (text or token ids).
With a reasoning parser, a choice's thinking part is in `reasoning_content`, as FastDeploy's. With
best_of > n each prompt's n best candidates are returned (not streamed)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from fastdeploy.engine.submission import Submission
from fastdeploy.entrypoints.multimodal import Prepared
from fastdeploy.entrypoints.openai.extras import ChunkGroups, completion_prompts, response_id
from fastdeploy.entrypoints.openai.protocol import CompletionRequest
from fastdeploy.entrypoints.openai.serving import (
    SSE_DONE, APIError, Choice, EventStream, ServingContext, Tally, draft_field, gather, make_submissions, now,
    request_outputs, sampling_params, json_logprob, sse, submit, top_entries, usage)
from fastdeploy.outputs import Logprob


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                        offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; text_offset counts from `offset` characters into the choice's text."""
    tokens, offsets = [], []
    for t, entry in zip(token_ids, entries):
        tokens.append(entry[t].decoded_token or "")
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [json_logprob(e[t].logprob) for t, e in zip(token_ids, entries)],
            "top_logprobs": [{lp.decoded_token or "": json_logprob(lp.logprob) for _, lp in top_entries(e, k)}
                             for e in entries],
            "text_offset": offsets}


def draft_completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int
                              ) -> dict[str, Any]:
    """`draft_logprobs` in the legacy shape: the accepted drafts' tokens only (offsets among them, as FastDeploy)."""
    kept = [(t, e) for t, e in zip(token_ids, entries) if e is not None]
    return completion_logprobs([t for t, _ in kept], [e for _, e in kept], k, 0)


async def create_completion(ctx: ServingContext, body: CompletionRequest, http: HTTPRequest) -> Response:
    ctx.check_model(body.model)
    ctx.limits.check(body)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (it needs the prompt's logprobs)", "echo")
    params = sampling_params(body.to_sampling_params)
    start = time.time()
    prompts = await run_in_threadpool(completion_prompts, ctx, body)  # tokenization, off the event loop
    submissions = await make_submissions(ctx, prompts, params, start, cache_salt=body.cache_salt)
    call_id, created = response_id("cmpl", body.request_id), now()
    k = body.logprobs or 0
    if body.stream:  # best_of > n was refused: every request is a choice
        echoes = [_echo(ctx, body, prompt) for prompt, s in zip(prompts, submissions) for _ in range(len(s))]
        queue = await submit(ctx, submissions, http, stream=True)
        return EventStream(_stream(ctx, body, submissions, queue, echoes, call_id, created, k), ctx, submissions)
    # Deltas, joined here; but best_of candidates come whole once all are done, ranked by the engine.
    queue = await submit(ctx, submissions, http, stream=not params.ranks_candidates)
    choices, tally = await gather(ctx, submissions, queue, http)
    # With best_of > n: each prompt's n best candidates, best first.
    returned = [(p, s.first_index + rank) for p, s in enumerate(submissions) for rank in range(s.num_returned)]
    return JSONResponse(completion_response(call_id, created, ctx.model_name, [
        completion_choice(body, i, _echo(ctx, body, prompts[p]), choices[c], submissions[p].prompt_token_ids)
        for i, (p, c) in enumerate(returned)], usage(ctx, submissions, tally)))  # usage: every candidate's tokens


def completion_choice(body: CompletionRequest, index: int, echo: str, choice: Choice, prompt_ids: list[int]
                      ) -> dict[str, Any]:
    """One choice of a whole text_completion body (the server's, and `fastdeploy run-batch`'s)."""
    out = {"index": index, "text": echo + choice.text, "reasoning_content": choice.reasoning,
           "logprobs": completion_logprobs(choice.token_ids, choice.logprobs, body.logprobs or 0, 0)
           if body.logprobs is not None else None,
           **(draft_field(body, choice.token_ids, choice.draft_logprobs, body.logprobs or 0, draft_completion_logprobs)
              if body.logprobs is not None else {}),
           "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
    if body.return_token_ids:
        out.update(prompt_token_ids=prompt_ids, completion_token_ids=choice.token_ids)
    return out


def completion_response(call_id: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage}


def _echo(ctx: ServingContext, body: CompletionRequest, prompt: Prepared) -> str:
    if not body.echo:
        return ""
    text, ids, _ = prompt
    return text if text is not None else ctx.engine.tokenizer.decode(ids, skip_special_tokens=False)


async def _stream(ctx: ServingContext, body: CompletionRequest, submissions: list[Submission], queue: asyncio.Queue,
                  echoes: list[str], call_id: str, created: int, k: int) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse({"id": call_id, "object": "text_completion", "created": created, "model": ctx.model_name,
                    "choices": choices, **extra})

    sent = [len(e) for e in echoes]  # characters of each choice's text sent so far (for text_offset)
    tally = Tally()
    groups = ChunkGroups(body.max_streaming_response_tokens)
    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
        async for output in request_outputs(ctx, submissions, queue):
            tally.add(output)
            out = output.outputs
            logprobs = None
            if body.logprobs is not None and out.token_ids:
                logprobs = completion_logprobs(out.token_ids, out.logprobs, k, sent[out.index])
            ids = body.return_token_ids and out.token_ids
            if not (out.text or out.reasoning_content or logprobs or ids or output.finished):
                continue  # text held back this step
            sent[out.index] += len(out.text or "")
            choice = {"index": out.index, "text": out.text or "", "logprobs": logprobs,
                      "finish_reason": out.finish_reason if output.finished else None}
            if logprobs is not None:
                choice.update(draft_field(body, out.token_ids, out.draft_logprobs, k, draft_completion_logprobs))
            if out.reasoning_content:
                choice["reasoning_content"] = out.reasoning_content
            if output.finished:
                choice["stop_reason"] = out.stop_reason
            if body.return_token_ids:
                choice["completion_token_ids"] = out.token_ids
            if (ready := groups.add(choice, output.finished)) is not None:
                yield chunk(ready)
        if (ready := groups.rest()) is not None:
            yield chunk(ready)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage=usage(ctx, submissions, tally))
    except APIError as e:
        yield sse({"error": {"message": e.message, "type": "internal_server_error", "code": e.status}})
    yield SSE_DONE
