"""The server's Prometheus metrics (FastDeploy's names), updated by the engine loop after each step."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import Request

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry):
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry)

        def counter(name: str, doc: str) -> Counter:  # exposed with the _total suffix
            return Counter(name, doc, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        self.running = gauge("fastdeploy:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("fastdeploy:num_requests_waiting", "Requests queued for a seat")
        self.cache_usage = gauge("fastdeploy:gpu_cache_usage_perc", "Share of KV-cache blocks in use (1 = all)")
        self.ttft = histogram("fastdeploy:time_to_first_token_seconds", "Arrival to first output token",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("fastdeploy:time_per_output_token_seconds", "Mean time between output tokens",
                              _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("fastdeploy:e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
        self.queue = histogram("fastdeploy:request_queue_time_seconds", "Arrival to first scheduled",
                               _LATENCY_BUCKETS)
        self.prompt_tokens = counter("fastdeploy:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("fastdeploy:generation_tokens", "Output tokens of finished requests")
        self.success = counter("fastdeploy:request_success", "Requests finished by stop or length")
        self.preemptions = counter("fastdeploy:num_preemptions", "Running requests preempted for KV blocks")
        self.prefix_hits = counter("fastdeploy:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        self._preempted = 0

    def on_step(self, engine: LLMEngine, stepped: list[Request]) -> None:
        """After a step: the engine's state; token counts and latencies of the requests that finished."""
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        blocks = engine.block_manager
        self.cache_usage.set(1.0 - blocks.num_free_blocks / max(len(blocks.blocks), 1))
        self.preemptions.inc(scheduler.num_preemptions - self._preempted)
        self._preempted = scheduler.num_preemptions
        for request in stepped:
            if request.is_finished:
                self._on_finished(request)

    def _on_finished(self, request: Request) -> None:
        m = request.metrics
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.generation_tokens.inc(request.num_output_tokens)
        self.prefix_hits.inc(request.num_cached_tokens)
        if request.finish_reason in ("stop", "length"):
            self.success.inc()
        if m.first_token_time is not None:  # FastDeploy's meaning: a duration from inference_start_time
            ttft = m.inference_start_time + m.first_token_time - m.arrival_time
            self.ttft.observe(ttft)
            if m.model_execute_time is not None:
                self.e2e.observe(m.model_execute_time)
                if request.num_output_tokens > 1:
                    self.tpot.observe((m.model_execute_time - ttft) / (request.num_output_tokens - 1))
        if m.time_in_queue is not None:
            self.queue.observe(m.time_in_queue)
