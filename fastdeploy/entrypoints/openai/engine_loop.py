"""One engine for every client: `EngineLoop.run()` steps the LLMEngine while there is work and hands
each request's output deltas to the asyncio queue of the API call that made it.

The server calls `run()` on the process's main thread and serves HTTP from another: the compiled ops'
OpenMP teams are measured 1.6x slower when a second thread drives them (libgomp throttles its
spin-waiting once it manages more threads than there are cores, so workers sleep between ops). The
loop sleeps on an event when idle (no polling); a new request or an abort wakes it. All text state
(detokenizers, stream cursors) is touched by this loop only: the API handlers receive ready
RequestOutput deltas.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import Request, RequestOutput
from fastdeploy.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0  # an idle loop re-checks its stop flag this often


@dataclass(slots=True)
class EngineFailed:
    """Put on every open queue when a step raised: the engine can no longer serve."""

    message: str


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.failed: str | None = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _queues
        self._wake = threading.Event()
        self._stop = threading.Event()

    def submit(self, requests: Sequence[Request]) -> asyncio.Queue:
        """Queue the requests (the n samples of one API call) for the next step; their RequestOutput
        deltas arrive on the returned queue, each request's last one with finished=True."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            for request in requests:
                self._queues[request.request_id] = (loop, queue)
        for request in requests:  # none is rejected: the caller answers those with the error itself
            self.engine.add_request(request)
        self._wake.set()
        return queue

    def abort(self, requests: Sequence[Request]) -> None:
        """The client is gone: abort what is still running; its blocks are freed at the next step."""
        for request in requests:
            if not request.is_finished:
                self.engine.abort_request(request.request_id)
        self._wake.set()

    def close(self) -> None:
        """Make run() return (from any thread)."""
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        """Step the engine until close() (or until a step fails: then every open call gets the error)."""
        engine = self.engine
        while not self._stop.is_set():
            if not engine.has_unfinished():
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                stepped = engine.step()
            except Exception as e:  # noqa: BLE001 - every client gets the error, the server stays up to say so
                logger.exception("engine step failed; failing every open request")
                self._fail(f"the engine failed: {type(e).__name__}")
                return
            for request in stepped:
                self._deliver(request)
            if self.metrics is not None:
                self.metrics.on_step(engine, stepped)

    def _deliver(self, request: Request) -> None:
        output: RequestOutput = self.engine.make_output(request, delta=True)
        with self._lock:
            target = self._queues.pop(request.request_id) if request.is_finished else \
                self._queues.get(request.request_id)
        if target is not None:
            self._send(target, output)

    @staticmethod
    def _send(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: object) -> None:
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the HTTP side has shut down: nobody is waiting
            pass

    def _fail(self, message: str) -> None:
        self.failed = message
        with self._lock:
            targets, self._queues = list(self._queues.values()), {}
        for target in targets:
            self._send(target, EngineFailed(message))
