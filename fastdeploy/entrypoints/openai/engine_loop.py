"""One engine for every client: `EngineLoop.run()` steps the LLMEngine while there is work and hands
each request's output deltas to the asyncio queue of the API call that made it.

The server calls `run()` on the process's main thread and serves HTTP from another: the compiled ops'
OpenMP teams are measured 1.6x slower when a second thread drives them (libgomp throttles its
spin-waiting once it manages more threads than there are cores, so workers sleep between ops). The
loop sleeps on an event when idle (no polling); a new request or an abort wakes it. All text state
(detokenizers, stream cursors) is touched by this loop only: the API handlers receive ready
RequestOutput deltas.

Faults: one request's failure in its output processing is that request's (the engine answers it with
error_code 500); a step that fails as a whole fails the calls open then, and the loop goes on. If the loop
itself dies, /health turns 503, `on_death` asks the process to stop, and run() re-raises so the server
exits non-zero (a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import Request, RequestOutput
from fastdeploy.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0  # an idle loop re-checks its stop flag this often
# Consecutive failed steps after which the engine is taken as broken (the loop dies): one failure may be one
# batch's (its open calls get 500), a runner failing on every batch would otherwise answer 500 forever at 200.
_MAX_FAILED_STEPS = 3


@dataclass(slots=True)
class EngineFailed:
    """Put on a call's queue when its requests failed with the step they were in (or their delivery)."""

    message: str


def stop_process() -> None:
    """The default on_death: SIGTERM to this process when a handler is installed for it (the server's, which
    stops uvicorn so main() can return and re-raise), never the default action that would kill it at once."""
    if callable(signal.getsignal(signal.SIGTERM)):
        signal.raise_signal(signal.SIGTERM)
    else:
        logger.critical("the engine loop died and no SIGTERM handler is installed to stop the process")


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 on_death: Callable[[], None] = stop_process):
        self.engine = engine
        self.metrics = metrics
        self.on_death = on_death  # called (on the loop's thread) when run() dies, before it re-raises
        self.failed: str | None = None  # set when the loop died: /health answers 503 with it
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
        """Step the engine until close(). If the loop dies, every open call gets the error, /health turns
        503, on_death() is called and the exception is re-raised: the loop never ends silently."""
        try:
            self._run()
        except BaseException as e:
            logger.critical("the engine loop died; failing every open request", exc_info=True)
            self._fail(f"the engine loop died: {type(e).__name__}")
            self.on_death()
            raise

    def _run(self) -> None:
        engine = self.engine
        failed_steps = 0
        while not self._stop.is_set():
            if not engine.has_unfinished():
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                stepped = engine.step()
            except Exception as e:
                failed_steps += 1
                if failed_steps >= _MAX_FAILED_STEPS:
                    raise
                logger.exception("engine step failed; failing the requests open in the engine")
                self._fail_open(f"the engine failed: {type(e).__name__}")
                continue
            failed_steps = 0
            for request in stepped:
                try:
                    self._deliver(request)
                except Exception as e:  # noqa: BLE001 - this call alone gets the error, the others go on
                    logger.exception("delivering request %s's output failed", request.request_id)
                    self._fail_request(request, f"internal error delivering this request's output: "
                                                f"{type(e).__name__}")
            if self.metrics is not None:
                self.metrics.on_step(engine, stepped)

    def _deliver(self, request: Request) -> None:
        output: RequestOutput = self.engine.make_output(request, delta=True)  # a failure there is an error output
        with self._lock:
            target = self._queues.pop(request.request_id) if request.is_finished else \
                self._queues.get(request.request_id)
        if target is not None:
            self._send(target, output)

    def _fail_request(self, request: Request, message: str) -> None:
        if not request.is_finished:
            self.engine.abort_now([request])  # on the stepping thread between steps: frees its blocks now
        else:
            self.engine.output_processor.release(request.request_id)
        with self._lock:
            target = self._queues.pop(request.request_id, None)
        if target is not None:
            self._send(target, EngineFailed(message))

    def _fail_open(self, message: str) -> None:
        """A step failed as a whole: its batch's state is unknown, so every request in the engine ends."""
        for request in self.engine.abort_all():
            self._fail_request(request, message)

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
