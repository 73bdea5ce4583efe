"""OpenAI-compatible API server on one engine (FastAPI + uvicorn):

    python -m fastdeploy.entrypoints.openai.api_server --model PATH --port 8180 [--metrics-port 8181]

POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics, and FastDeploy's and
vLLM's GET|POST /ping, GET /config-info, POST /tokenize, POST /detokenize (serving_tokens.py). Every client's
requests join the same continuous batch, stepped by the engine loop on the main thread (engine_loop.py);
uvicorn serves HTTP from a second thread. On SIGTERM/SIGINT the server answers 503 to new calls, lets
running ones finish for --timeout-graceful-shutdown seconds, aborts the rest, stops the
tensor-parallel workers and exits 0.
"""
from __future__ import annotations

import argparse
import faulthandler
import hmac
import logging
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, start_http_server
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from fastdeploy.config import EngineConfig
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.entrypoints.multimodal import prompts_for
from fastdeploy.input.media import MediaPolicy
from fastdeploy.entrypoints.openai.cli_args import (MAX_REQUEST_BODY_BYTES, api_keys,
                                                    check_fastdeploy_server_flags, engine_config, make_parser,
                                                    media_policy, request_limits)
from fastdeploy.entrypoints.openai.data_parallel import core_shares, serve as serve_replicas
from fastdeploy.entrypoints.openai.engine_loop import EngineLoop, stop_process
from fastdeploy.entrypoints.openai.metrics import ServerMetrics
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, error_body
from fastdeploy.entrypoints.openai.serving import APIError, EventStream, RequestLimits, ServingContext
from fastdeploy.entrypoints.openai.serving_chat import create_chat_completion
from fastdeploy.entrypoints.openai.serving_completion import create_completion
from fastdeploy.entrypoints.openai.serving_tokens import add_routes

logger = logging.getLogger("fastdeploy.api_server")


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# Behind the API key besides /v1: the routes that do work for a client or describe the configuration (vLLM and
# FastDeploy leave them open; a key-holder's tools send the key anyway). /health, /ping and /metrics stay open
# for probes and scrapers.
KEYED_PATHS = ("/tokenize", "/detokenize", "/config-info")


def _is_json(headers: dict[bytes, bytes]) -> bool:
    media_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return media_type == b"application/json"


class Gatekeeper:
    """ASGI middleware (pure, so streaming and client disconnects pass straight through): 503 while
    shutting down, 401 on /v1 and KEYED_PATHS without one of the API keys, 415 for a POST body that is not declared JSON
    (a web page can send a form or text/plain body cross-site without a CORS preflight, never JSON), 413 for a
    POST body over max_body_bytes: from its Content-Length before reading, or once a chunked body passes it."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str] | None, max_body_bytes: int = MAX_REQUEST_BODY_BYTES):
        self.app = app
        self.api_keys = [f"Bearer {k}".encode() for k in api_keys or ()]
        self.max_body_bytes = max_body_bytes
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = None
            headers = dict(scope["headers"])
            if self.draining:
                refusal = error_response(503, "the server is shutting down")
            elif self.api_keys and (scope["path"].startswith("/v1") or scope["path"] in KEYED_PATHS) and not any(
                    hmac.compare_digest(headers.get(b"authorization", b""), key) for key in self.api_keys):
                refusal = error_response(401, "missing or wrong API key: send `Authorization: Bearer KEY`")
            elif scope["method"] == "POST" and not _is_json(headers) and scope["path"] != "/ping":
                # (a probe's POST /ping carries no body, and /ping does nothing a page could abuse)
                refusal = error_response(415, "the body must be JSON sent with `Content-Type: application/json`")
            elif scope["method"] == "POST" and _declared_length(headers) > self.max_body_bytes:
                refusal = self._too_large()
            elif scope["method"] == "POST":
                # The endpoints parse the whole JSON body anyway: read it here, stopping at the limit, and
                # hand it on (later receives, e.g. disconnect polls, go to the client's connection).
                body = await _read_body(receive, self.max_body_bytes)
                if body is None:
                    refusal = self._too_large()
                else:
                    receive = _replay(body, receive)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _too_large(self) -> JSONResponse:
        return error_response(413, f"the request body is larger than --max-request-body-bytes={self.max_body_bytes}")


def _declared_length(headers: dict[bytes, bytes]) -> int:
    try:
        return int(headers.get(b"content-length", b"0"))
    except ValueError:
        return 0  # h11 refuses a malformed Content-Length before the app sees it; the read bound still holds


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None as soon as it passes `limit` bytes (the rest is never read)."""
    parts, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client left: an empty body, the app sees it go
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        more = message.get("more_body", False)
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    problems, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        param = param or (loc[0] if loc else None)
        problems.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    return "; ".join(problems), param


def build_app(ctx: ServingContext, api_keys: Sequence[str] | None = None,
              registry: CollectorRegistry | None = None, max_body_bytes: int = MAX_REQUEST_BODY_BYTES) -> Gatekeeper:
    """The API app behind its gatekeeper (which also switches to draining); /metrics from `registry`
    if given."""
    app = FastAPI(title="FastDeploy OpenAI-compatible API", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own 404 / 405 would be {"detail": ...}; clients parse OpenAI's shape.
        return error_response(exc.status_code, f"{exc.detail}: {http.method} {http.url.path}", headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(Exception)
    async def internal(_: HTTPRequest, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(500, "internal server error")

    async def serve(handler: Callable[..., Awaitable[Response]], body: Any, http: HTTPRequest) -> Response:
        ctx.admit()
        try:
            response = await handler(ctx, body, http)
        except BaseException:
            ctx.release()
            raise
        if isinstance(response, EventStream):  # the slot is held until the stream ends, however it ends
            response.on_close.append(ctx.release)
        else:
            ctx.release()
        return response

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HTTPRequest) -> Response:
        return await serve(create_chat_completion, body, http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest) -> Response:
        return await serve(create_completion, body, http)

    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": created, "owned_by": "fastdeploy",
            "root": ctx.model_name, "max_model_len": ctx.engine.config.max_model_len}]}

    def healthy() -> Response:
        if ctx.loop.failed:
            return error_response(503, ctx.loop.failed)
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    async def health() -> Response:
        return healthy()

    add_routes(app, ctx, healthy, max_body_bytes)

    if registry is not None:
        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Gatekeeper(app, api_keys, max_body_bytes)


def served_name(model: str) -> str:
    """The API's model name without --served-model-name: a checkpoint directory's own name (its path on
    disk is no client's business), a hub repo id as given."""
    path = Path(model)
    return path.resolve().name or model if path.exists() else model


def _serve_http(server: uvicorn.Server, loop: EngineLoop) -> None:
    try:
        server.run()  # off the main thread uvicorn installs no signal handlers: main() routes them here
    finally:
        loop.close()


@dataclass(frozen=True)
class ServerSettings:
    """The server's flags, validated: what one engine and its API need."""

    api_keys: list[str]
    config: EngineConfig
    media: MediaPolicy
    limits: RequestLimits


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """ValueError/TypeError/NotImplementedError naming the first flag this server cannot honour."""
    check_fastdeploy_server_flags(args)
    keys = api_keys(args)
    return ServerSettings(keys, engine_config(args), media_policy(args), request_limits(args))


def serving_app(args: argparse.Namespace, settings: ServerSettings, engine: LLMEngine,
                on_death: Callable[[], None] = stop_process) -> tuple[EngineLoop, Gatekeeper, CollectorRegistry]:
    """The engine's loop (not yet running), the API app over it, and the registry of its metrics (on /metrics
    unless --metrics-port serves them)."""
    config = settings.config
    registry = CollectorRegistry()
    loop = EngineLoop(engine, ServerMetrics(registry, config), on_death)
    name = config.served_model_name or served_name(args.model)
    ctx = ServingContext(engine, loop, prompts_for(config, engine.tokenizer, settings.media), name,
                         args.max_concurrency, args.max_waiting_time if args.max_waiting_time >= 0 else None,
                         args.trust_request_chat_template, accepted_names=(args.model,),
                         prompt_tokens_details=args.enable_prompt_tokens_details, limits=settings.limits)
    gate = build_app(ctx, settings.api_keys, registry if args.metrics_port is None else None,
                     args.max_request_body_bytes)
    return loop, gate, registry


def main(argv: Sequence[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    replicas = args.data_parallel_size  # > 1: engines behind this process (data_parallel.py), each as below
    if replicas < 1:
        parser.error(f"--data-parallel-size must be >= 1, got {replicas}")
    try:
        settings = server_settings(args)
        if replicas > 1:
            if settings.config.launch is not None:
                raise ValueError("--data-parallel-size runs its engines on this host; under paddle.distributed.launch "
                                 "run one server per launch instead (docs/distributed.md)")
            core_shares(replicas)
            if args.metrics_port is not None:
                raise ValueError("--metrics-port: with --data-parallel-size the engines' metrics are served on the "
                                 "API port (/metrics)")
    except (ValueError, TypeError, NotImplementedError) as e:
        parser.error(str(e))
    if replicas > 1:
        serve_replicas(args, sys.argv[1:] if argv is None else argv, replicas)
        return
    # A crash in native code then prints every thread's Python stack and the process dies of the signal.
    # Enabled after fastdeploy's import has taken Paddle's handlers down, so the one it chains to is the default.
    faulthandler.enable()
    engine = LLMEngine(settings.config)
    loop, gate, registry = serving_app(args, settings, engine)
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, addr=args.host, registry=registry)
    server = uvicorn.Server(uvicorn.Config(gate, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.timeout_graceful_shutdown))

    def stop(sig: int, frame: Any) -> None:
        gate.draining = True
        server.handle_exit(sig, frame)  # uvicorn's own: graceful first, forced on a second signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    http = threading.Thread(target=_serve_http, args=(server, loop), name="fastdeploy-http")
    http.start()
    try:
        loop.run()  # until the HTTP server has stopped
    finally:
        loop.close()
        http.join()
        engine.runner.close()
    logger.info("server stopped")
    if not server.started:
        sys.exit(1)  # e.g. the port was taken


if __name__ == "__main__":
    main()
