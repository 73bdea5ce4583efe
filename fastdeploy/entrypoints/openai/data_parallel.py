"""`--data-parallel-size K` (FastDeploy's flag): K engines behind one API port.

The process that was asked to serve starts K engine servers (this module's `api_server`, each with the same flags,
bound to 127.0.0.1 on a port of its own) and becomes their front: every call goes whole, streamed or not, to the
engine with the fewest calls in flight, so each engine batches its own share. Engines are processes, each pinned to
its share of this process's cores (the compiled ops take their threads from that mask), since one process's
OpenMP teams slow down when several threads drive them (engine_loop.py).

- GET /health: 200 while every engine answers its own /health with 200, else 503 naming the one that does not
  (a load balancer takes the whole server out); GET /metrics: every engine's metrics with a `dp_rank` label.
- The API keys, limits and every other flag are each engine's; the front forwards requests as they are.
- An engine that exits makes the front stop (exit status 1) so that a supervisor restarts the whole server;
  SIGTERM/SIGINT stop the front and then the engines, each draining as a single server does.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from fastdeploy.entrypoints.openai.protocol import error_body

logger = logging.getLogger("fastdeploy.data_parallel")

STARTUP_TIMEOUT_S = 1800.0  # loading (and quantizing) a large checkpoint takes minutes
_WATCH_S = 1.0
_PR_SET_PDEATHSIG = 1  # prctl(2)
# Flags that are the front's own; the engines get their own host and port (--metrics-port is refused with K > 1).
_FRONT_FLAGS = ("--host", "--port", "--data-parallel-size")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length", "host"}


def core_shares(k: int) -> list[list[int]]:
    """This process's cores split into k equal contiguous shares (ValueError when there are fewer than k)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < k:
        raise ValueError(f"--data-parallel-size {k} needs at least {k} cores; this process may use {len(cores)}")
    per = len(cores) // k
    return [cores[i * per:(i + 1) * per] for i in range(k)]


def engine_argv(argv: Sequence[str], port: int) -> list[str]:
    """An engine's flags: the front's, without its own ones, on 127.0.0.1:`port`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _FRONT_FLAGS:
            skip = True  # and its value
        elif not arg.startswith(tuple(f"{flag}=" for flag in _FRONT_FLAGS)):
            out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engines:
    """The engine processes, their ports and how many calls each has in flight."""

    def __init__(self, argv: Sequence[str], k: int) -> None:
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.in_flight = [0] * k
        self.turn = 0  # breaks ties round-robin, so idle engines share the first calls
        self.failed: str | None = None
        self.stopping = False  # set before the engines are stopped on purpose: their exits are no failure
        for cores in core_shares(k):
            port = _free_port()
            self.urls.append(f"http://127.0.0.1:{port}")
            proc = subprocess.Popen([sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server",
                                     *engine_argv(argv, port)], start_new_session=True, preexec_fn=_die_with_parent)
            os.sched_setaffinity(proc.pid, cores)  # long before it counts its cores (after its imports)
            self.procs.append(proc)
        logger.info("data parallel: %d engines (pids %s) on %s", k, [p.pid for p in self.procs], self.urls)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for rank, url in enumerate(self.urls):
            while not _healthy(url):
                if self.procs[rank].poll() is not None:
                    raise RuntimeError(f"data-parallel engine {rank} exited with {self.procs[rank].returncode} "
                                       "while starting (its log is above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"data-parallel engine {rank} did not come up in {timeout_s:.0f} s")
                time.sleep(0.2)

    def pick(self) -> int:
        k = len(self.urls)
        rank = min(range(k), key=lambda r: (self.in_flight[r], (r - self.turn) % k))
        self.turn = (rank + 1) % k
        self.in_flight[rank] += 1
        return rank

    def watch(self, on_death: Callable[[], None]) -> None:
        """Until an engine exits (then `on_death()`), on a daemon thread."""
        while self.failed is None and not self.stopping:
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None and not self.stopping:
                    self.failed = f"data-parallel engine {rank} exited with {proc.returncode}"
                    logger.critical(self.failed)
                    on_death()
                    return
            time.sleep(_WATCH_S)

    def stop(self, grace_s: float) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 30
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _die_with_parent() -> None:
    """In an engine before it runs: SIGTERM when the front is gone, however it ended (Linux's parent-death
    signal; the engine then drains and exits as on any SIGTERM)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def build_front(engines: Engines, max_body_bytes: int) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="fastdeploy (data parallel)", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        if engines.failed:
            return JSONResponse(error_body(503, engines.failed), status_code=503)
        checks = await asyncio.gather(*(client.get(f"{url}/health", timeout=5) for url in engines.urls),
                                      return_exceptions=True)
        for rank, check in enumerate(checks):
            if isinstance(check, BaseException) or check.status_code != 200:
                return JSONResponse(error_body(503, f"data-parallel engine {rank} is not healthy"), status_code=503)
        return JSONResponse({"status": "ok", "data_parallel_size": len(engines.urls)})

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await asyncio.gather(*(client.get(f"{url}/metrics", timeout=10) for url in engines.urls))
        return Response(merged_metrics([t.text for t in texts]), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(path: str, http: HTTPRequest) -> Response:
        body = bytearray()
        async for chunk in http.stream():  # bounded as each engine bounds it, before anything is sent on
            body += chunk
            if len(body) > max_body_bytes:
                return JSONResponse(error_body(413, f"the request body exceeds {max_body_bytes} bytes"), status_code=413)
        call = _Call(engines)
        try:
            headers = {k: v for k, v in http.headers.items() if k.lower() not in _HOP_BY_HOP}
            upstream = client.build_request(http.method, f"{engines.urls[call.rank]}/{path}",
                                            params=http.query_params, headers=headers, content=bytes(body))
            call.answer = await client.send(upstream, stream=True)
        except BaseException:
            await call.release()
            raise
        return StreamingResponse(call.body(), status_code=call.answer.status_code,
                                 background=BackgroundTask(call.release),
                                 headers={k: v for k, v in call.answer.headers.items() if k.lower() not in _HOP_BY_HOP})

    return app


class _Call:
    """One forwarded call: its engine's seat, held until the answer is sent or the client has left (released once,
    by whichever comes first; closing the engine's stream makes the engine abort the call)."""

    def __init__(self, engines: Engines) -> None:
        self.engines, self.rank = engines, engines.pick()
        self.answer: httpx.Response | None = None
        self.released = False

    async def body(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.answer.aiter_raw():
                yield chunk
        finally:
            await self.release()

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.engines.in_flight[self.rank] -= 1
            if self.answer is not None:
                await self.answer.aclose()


def merged_metrics(texts: Sequence[str]) -> bytes:
    """The engines' Prometheus expositions as one, each sample labelled with its engine's `dp_rank`."""
    families: dict[str, Any] = {}
    for rank, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, family)
            samples = [s._replace(labels={**s.labels, "dp_rank": str(rank)}) for s in family.samples]
            if merged is family:
                family.samples = samples
            else:
                merged.samples.extend(samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def serve(args: argparse.Namespace, argv: Sequence[str], k: int) -> None:
    """Run the front and its `k` engines until SIGTERM/SIGINT or an engine's exit (then exit status 1)."""
    engines = Engines(argv, k)
    try:
        engines.wait_ready()
        server = uvicorn.Server(uvicorn.Config(build_front(engines, args.max_request_body_bytes),
                                               host=args.host, port=args.port, log_level=args.log_level,
                                               timeout_graceful_shutdown=args.timeout_graceful_shutdown))
        # uvicorn serves from a thread, where it installs no signal handlers (on the main thread it would raise
        # the signal again once stopped, ending the process by it): these stop it gracefully instead.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
        http = threading.Thread(target=server.run, name="fastdeploy-http")
        http.start()
        threading.Thread(target=engines.watch, args=(lambda: setattr(server, "should_exit", True),),
                         name="fastdeploy-dp-watch", daemon=True).start()
        while http.is_alive():
            http.join(_WATCH_S)  # a bounded wait, so the main thread runs the signal handlers
    finally:
        engines.stop(args.timeout_graceful_shutdown or 0)
    if engines.failed or not server.started:
        sys.exit(1)
