"""The server's other routes FastDeploy and vLLM users reach for: POST /tokenize and /detokenize (vLLM's
shapes), GET /config-info (FastDeploy's: what a client may know of the configuration, nothing more) and
/ping (FastDeploy's and SageMaker's health probe)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jinja2
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from fastdeploy.entrypoints.openai.serving import APIError, ServingContext
from fastdeploy.tool_parsers import check_tools

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)

# The engine settings /config-info shows: what shapes a client's requests. Left out on purpose: paths (model,
# tokenizer, chat_template, which may name a file), ports, and the engine-wide seed (with it a client could
# reproduce the draws of other clients' unseeded requests).
_VISIBLE_ENGINE = ("max_model_len", "tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens",
                   "enable_prefix_caching", "enable_chunked_prefill", "enable_mm", "limit_mm_per_prompt",
                   "reasoning_parser", "tool_call_parser", "guided_decoding_backend",
                   "guided_decoding_disable_any_whitespace", "quantization", "dtype", "max_logprobs",
                   "enable_logprob", "logprobs_mode")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a completion's `prompt`, or a chat's `messages` rendered as /v1/chat/completions
    renders them (the server's template; a request's own template is not taken here)."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


def _tokenize(ctx: ServingContext, body: TokenizeRequest) -> list[int]:
    """The token ids of the body's prompt (on a worker thread: tokenization, template rendering, media)."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either prompt or messages", "prompt")
    if body.prompt is not None:
        return ctx.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    if body.add_special_tokens:
        raise APIError(400, "add_special_tokens: the chat template writes a chat's special tokens itself (only "
                            "false is accepted with messages)", "add_special_tokens")
    kwargs = dict(body.chat_template_kwargs or {})
    if "chat_template" in kwargs:
        raise APIError(400, "chat_template_kwargs.chat_template: /tokenize renders with the server's template only",
                       "chat_template_kwargs")
    kwargs.update(add_generation_prompt=body.add_generation_prompt,
                  continue_final_message=body.continue_final_message)
    try:
        tools = check_tools(body.tools)  # as the chat endpoint checks them
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), "tools") from None
    try:
        return list(ctx.prompts.from_chat(body.messages, kwargs, None, tools)[1])
    except (ValueError, TypeError, NotImplementedError, jinja2.TemplateError) as e:
        raise APIError(400, f"messages: {e}", "messages") from None


def _config_info(ctx: ServingContext, max_body_bytes: int) -> dict[str, Any]:
    config = ctx.engine.config
    return {
        "model": ctx.model_name,
        "vocab_size": config.model_config.vocab_size,
        "engine": {name: getattr(config, name) for name in _VISIBLE_ENGINE},
        "server": {"max_concurrency": ctx.max_concurrency, "max_waiting_time": ctx.max_waiting_time,
                   "max_request_body_bytes": max_body_bytes, "max_n": ctx.limits.max_n,
                   "max_stop_strings": ctx.limits.max_stop_strings,
                   "max_stop_string_chars": ctx.limits.max_stop_string_chars,
                   "max_prompts": ctx.limits.max_prompts,
                   "trust_request_chat_template": ctx.trust_request_chat_template,
                   "enable_prompt_tokens_details": ctx.prompt_tokens_details},
    }


def add_routes(app: FastAPI, ctx: ServingContext, health: Callable[[], Response], max_body_bytes: int) -> None:
    """Register /ping, /config-info, /tokenize and /detokenize on `app` (the API key is the gatekeeper's)."""

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return health()

    @app.get("/config-info")
    async def config_info() -> dict[str, Any]:
        return _config_info(ctx, max_body_bytes)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        ctx.admit()  # rendering and media take a worker thread: counted in --max-concurrency as a call is
        try:
            ids = await run_in_threadpool(_tokenize, ctx, body)
        finally:
            ctx.release()
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.engine.config.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = ctx.engine.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        vocab = ctx.engine.config.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", "tokens")
        text = await run_in_threadpool(ctx.engine.tokenizer.decode, body.tokens, False)
        return JSONResponse({"prompt": text})
