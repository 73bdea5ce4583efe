"""One engine for every client: `EngineLoop.run()` steps the LLMEngine while there is work; each
request's outputs go, inside the step, to the asyncio queue of the API call that submitted it.

The server calls `run()` on the process's main thread and serves HTTP from another: the compiled ops'
OpenMP teams are measured 1.6x slower when a second thread drives them (libgomp throttles its
spin-waiting once it manages more threads than there are cores, so workers sleep between ops). The
loop sleeps on an event when idle (no polling); a new request or an abort wakes it. All text state
(detokenizers, stream cursors) is the engine's: the API handlers receive ready RequestOutputs.

Faults: one request's failure is that request's (the engine answers it with error_code 500); a step that
fails as a whole fails the requests open then, and the loop goes on. If the loop itself dies, /health turns
503, `on_death` asks the process to stop, and run() re-raises so the server exits non-zero (a supervisor
restarts it).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
from collections.abc import Callable, Sequence

from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.submission import Submission
from fastdeploy.entrypoints.openai.metrics import ServerMetrics
from fastdeploy.outputs import RequestOutput

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0  # an idle loop re-checks its stop flag this often
# Consecutive failed steps after which the engine is taken as broken (the loop dies): one failure may be one
# batch's (its open calls get 500), a runner failing on every batch would otherwise answer 500 forever at 200.
_MAX_FAILED_STEPS = 3


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
        self._wake = threading.Event()
        self._stop = threading.Event()

    def submit(self, submissions: Sequence[Submission], stream: bool) -> asyncio.Queue:
        """Queue one API call's prompts for the next step; their RequestOutputs arrive on the returned queue
        (stream: a delta each step, else each request's whole output once finished, a best_of prompt's
        candidates best first), each request's last one with finished=True. None is rejected: the caller
        answers those with the error itself."""
        queue: asyncio.Queue = asyncio.Queue()
        if self.metrics is not None:
            self.metrics.on_submit(list(submissions))
        self.engine.submit(list(submissions), functools.partial(self._sink, asyncio.get_running_loop(), queue), stream)
        self._wake.set()
        return queue

    def _sink(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, output: RequestOutput) -> None:
        """Hand an output to its call's queue (on the stepping thread)."""
        try:
            loop.call_soon_threadsafe(queue.put_nowait, output)
        except RuntimeError:  # the HTTP side has shut down: nobody is waiting
            pass
        if self.metrics is not None:
            self.metrics.on_output(output)

    def abort(self, request_ids: Sequence[str]) -> None:
        """The client is gone: abort what is still running; its blocks are freed at the next step."""
        self.engine.abort(list(request_ids))
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
            self.failed = f"the engine loop died: {type(e).__name__}"
            try:
                self.engine.fail_all(self.failed)
            except Exception:  # noqa: BLE001 - the engine may be what broke; the process is stopping anyway
                logger.exception("failing the open requests failed too")
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
                engine.step()
            except Exception as e:
                failed_steps += 1
                if failed_steps >= _MAX_FAILED_STEPS:
                    raise
                logger.exception("engine step failed; failing the requests open in the engine")
                engine.fail_all(f"the engine failed: {type(e).__name__}")
                continue
            failed_steps = 0
            if self.metrics is not None:
                self.metrics.on_stats(engine.stats())
