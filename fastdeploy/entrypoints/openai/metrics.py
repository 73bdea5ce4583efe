"""The server's Prometheus metrics (FastDeploy's names): the engine's stats after each step, and each
request's outputs as the engine hands them to their call."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fastdeploy.engine.submission import EngineStats
from fastdeploy.outputs import RequestOutput

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
        self._generated: dict[str, int] = {}  # output tokens of each streamed request so far

    def on_stats(self, stats: EngineStats) -> None:
        """After a step: the engine's state."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.cache_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions - self._preempted)
        self._preempted = stats.num_preemptions

    def on_output(self, output: RequestOutput) -> None:
        """Each output a request makes (a stream delta, or its whole output): token counts and latencies once
        it finished."""
        generated = self._generated.pop(output.request_id, 0) + len(output.outputs.token_ids)
        if not output.finished:
            self._generated[output.request_id] = generated
            return
        m = output.metrics
        self.prompt_tokens.inc(output.prompt_token_ids_len)
        self.generation_tokens.inc(generated)
        self.prefix_hits.inc(output.num_cached_tokens)
        if output.outputs.finish_reason in ("stop", "length") and output.error_code == 200:
            self.success.inc()
        if m.first_token_time is not None:  # FastDeploy's meaning: a duration from inference_start_time
            ttft = m.inference_start_time + m.first_token_time - m.arrival_time
            self.ttft.observe(ttft)
            if m.model_execute_time is not None:
                self.e2e.observe(m.model_execute_time)
                if generated > 1:
                    self.tpot.observe((m.model_execute_time - ttft) / (generated - 1))
        if m.time_in_queue is not None:
            self.queue.observe(m.time_in_queue)
