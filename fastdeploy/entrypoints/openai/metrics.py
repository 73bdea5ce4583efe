"""The server's Prometheus metrics under FastDeploy's `fastdeploy:*` names and types
(docs/online_serving.md, "Metrics"): the engine's stats after each step, each API call's requests as they are
submitted, and each request's outputs as the engine hands them to their call. FastDeploy's metrics of a
CPU swap tier or of prefill/decode disaggregation have no meaning here and are not exported.

Speculative decoding's `fastdeploy:spec_decode_*` metrics exist only on a server started with a speculative_config
(FastDeploy registers them only when it decodes speculatively); see SpeculationMetrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fastdeploy.config import EngineConfig
from fastdeploy.engine.submission import EngineStats, Submission
from fastdeploy.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # tokens per second


class SpeculationMetrics:
    """FastDeploy's speculative-decoding metrics that this engine can give exactly, from each request's running
    RequestMetrics.num_draft_tokens / num_accepted_tokens (every output carries the counts so far, so a stream
    is counted as its deltas arrive, a whole output when it is handed over):

    - num_draft_tokens: tokens the drafter proposed (FastDeploy counts these only for MTP, where every step
      drafts num_speculative_tokens; an ngram lookup drafts fewer or none, and here each draft is counted);
    - num_accepted_tokens: draft tokens the model agreed with, hence emitted;
    - num_emitted_tokens: every output token, FastDeploy's "tokens output by the entire system" (a verify step
      emits its accepted drafts and the model's own next token);
    - draft_acceptance_rate: accepted / drafted since the start, FastDeploy's MTP definition (its ngram path
      divides by emitted tokens for want of a draft count, which this engine has).

    Not exported: spec_decode_efficiency (emitted / (steps x (k + 1))) and
    spec_decode_draft_single_head_acceptance_rate_<j> (of the steps that reached draft position j, the share
    that accepted it): the engine keeps no count of a request's steps nor of drafts by position."""

    def __init__(self, registry: CollectorRegistry):
        self.draft_tokens = Counter("fastdeploy:spec_decode_num_draft_tokens",
                                    "Tokens proposed by the drafter (speculative decoding)", registry=registry)
        self.accepted_tokens = Counter("fastdeploy:spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted by the model", registry=registry)
        self.emitted_tokens = Counter("fastdeploy:spec_decode_num_emitted_tokens",
                                      "Output tokens (accepted drafts and the model's own)", registry=registry)
        self.acceptance_rate = Gauge("fastdeploy:spec_decode_draft_acceptance_rate",
                                     "Accepted / drafted tokens since the server started", registry=registry)
        self._drafted = self._accepted = 0
        self._seen: dict[str, tuple[int, int]] = {}  # (drafted, accepted) so far of each streamed request

    def on_output(self, output: RequestOutput) -> None:
        seen = self._seen.pop(output.request_id, (0, 0))
        m = output.metrics
        counts = seen if m is None else (m.num_draft_tokens, m.num_accepted_tokens)
        if not output.finished:
            self._seen[output.request_id] = counts
        drafted, accepted = counts[0] - seen[0], counts[1] - seen[1]
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        self.emitted_tokens.inc(len(output.outputs.token_ids))
        self._drafted += drafted
        self._accepted += accepted
        if self._drafted:
            self.acceptance_rate.set(self._accepted / self._drafted)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry, config: EngineConfig | None = None):
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:  # exposed with the _total suffix
            return Counter(name, doc, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        # Requests
        self.requests = counter("fastdeploy:requests_number", "Requests received (each sample of n counts)")
        self.success = counter("fastdeploy:request_success", "Requests finished by a stop or by length")
        self.running = gauge("fastdeploy:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("fastdeploy:num_requests_waiting", "Requests queued for a seat")
        self.preemptions = counter("fastdeploy:num_preemptions", "Running requests preempted for KV blocks")
        # Latency
        self.ttft = histogram("fastdeploy:time_to_first_token_seconds", "Arrival to first output token",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("fastdeploy:time_per_output_token_seconds", "Mean time between output tokens",
                              _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("fastdeploy:e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
        self.inference = histogram("fastdeploy:request_inference_time_seconds", "First scheduled to last token",
                                   _LATENCY_BUCKETS)
        self.queue = histogram("fastdeploy:request_queue_time_seconds", "Arrival to first scheduled", _LATENCY_BUCKETS)
        self.prefill = histogram("fastdeploy:request_prefill_time_seconds", "First scheduled to first token",
                                 _LATENCY_BUCKETS)
        self.decode = histogram("fastdeploy:request_decode_time_seconds", "First token to last token",
                                _LATENCY_BUCKETS)
        # Tokens
        self.prompt_tokens = counter("fastdeploy:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("fastdeploy:generation_tokens", "Output tokens of finished requests")
        self.request_prompt_tokens = histogram("fastdeploy:request_prompt_tokens", "Prompt tokens per request",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("fastdeploy:request_generation_tokens",
                                                   "Output tokens per request", _TOKEN_BUCKETS)
        self.token_ratio = histogram("fastdeploy:request_token_ratio",
                                     "Output tokens per second of a request, from first scheduled", _RATE_BUCKETS)
        self.max_tokens = histogram("fastdeploy:request_params_max_tokens", "max_tokens per request (as resolved)",
                                    _TOKEN_BUCKETS)
        # Batch
        self.available_batch = gauge("fastdeploy:available_batch_size", "Seats free in the running batch")
        self.batch = gauge("fastdeploy:batch_size", "Requests in the last step")
        self.max_batch = gauge("fastdeploy:max_batch_size", "max_num_seqs")
        # KV cache (the pool is host memory; FastDeploy's "gpu" names are kept for its dashboards)
        self.hit_req_rate = gauge("fastdeploy:hit_req_rate", "Share of finished requests with a prefix-cache hit")
        self.hit_token_rate = gauge("fastdeploy:hit_token_rate", "Share of prompt tokens served from the prefix cache")
        self.gpu_hit_token_rate = gauge("fastdeploy:gpu_hit_token_rate", "hit_token_rate (the one KV pool)")
        self.prefix_tokens = counter("fastdeploy:prefix_cache_token_num", "Prompt tokens served from the prefix cache")
        self.prefix_gpu_tokens = counter("fastdeploy:prefix_gpu_cache_token_num", "prefix_cache_token_num")
        self.available_blocks = gauge("fastdeploy:available_gpu_block_num",
                                      "KV blocks not held by a request (cached prefixes included)")
        self.free_blocks = gauge("fastdeploy:free_gpu_block_num", "KV blocks holding nothing")
        self.max_blocks = gauge("fastdeploy:max_gpu_block_num", "KV blocks in the pool")
        self.available_resource = gauge("fastdeploy:available_gpu_resource", "available_gpu_block_num / pool")
        self.cache_usage = gauge("fastdeploy:gpu_cache_usage_perc", "Share of KV-cache blocks in use (1 = all)")
        if config is not None:
            info = gauge("fastdeploy:cache_config_info", "The KV cache's configuration (in the labels)",
                         ("block_size", "cache_dtype", "enable_prefix_caching", "kv_cache_ratio"))
            info.labels(str(config.block_size), config.kv_cache_dtype, str(config.enable_prefix_caching),
                        str(config.kv_cache_ratio)).set(1)
        # Speculative decoding: only when configured, as FastDeploy
        self.speculation = None if config is None or config.speculative is None else SpeculationMetrics(registry)
        self._preempted = 0
        self._finished = self._hit_requests = self._all_prompt_tokens = self._hit_tokens = 0
        self._generated: dict[str, int] = {}  # output tokens of each streamed request so far

    def on_submit(self, submissions: list[Submission]) -> None:
        for submission in submissions:
            self.requests.inc(len(submission))
            for _ in range(len(submission)):
                self.max_tokens.observe(submission.max_tokens)

    def on_stats(self, stats: EngineStats) -> None:
        """After a step: the engine's state."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.cache_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions - self._preempted)
        self._preempted = stats.num_preemptions
        self.available_batch.set(max(stats.max_num_seqs - stats.num_running, 0))
        self.batch.set(stats.batch_size)
        self.max_batch.set(stats.max_num_seqs)
        self.available_blocks.set(stats.num_free_blocks)
        self.free_blocks.set(stats.num_free_blocks - stats.num_cached_free_blocks)
        self.max_blocks.set(stats.num_blocks)
        self.available_resource.set(stats.num_free_blocks / max(stats.num_blocks, 1))

    def on_output(self, output: RequestOutput) -> None:
        """Each output a request makes (a stream delta, or its whole output): token counts and latencies once
        it finished; speculation counts as they come."""
        if self.speculation is not None:
            self.speculation.on_output(output)
        generated = self._generated.pop(output.request_id, 0) + len(output.outputs.token_ids)
        if not output.finished:
            self._generated[output.request_id] = generated
            return
        self._on_finished(output, generated)

    def _on_finished(self, output: RequestOutput, generated: int) -> None:
        m, prompt = output.metrics, output.prompt_token_ids_len
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.request_prompt_tokens.observe(prompt)
        self.request_generation_tokens.observe(generated)
        self.prefix_tokens.inc(output.num_cached_tokens)
        self.prefix_gpu_tokens.inc(output.num_cached_tokens)
        self._finished += 1
        self._hit_requests += output.num_cached_tokens > 0
        self._all_prompt_tokens += prompt
        self._hit_tokens += output.num_cached_tokens
        self.hit_req_rate.set(self._hit_requests / self._finished)
        self.hit_token_rate.set(self._hit_tokens / max(self._all_prompt_tokens, 1))
        self.gpu_hit_token_rate.set(self._hit_tokens / max(self._all_prompt_tokens, 1))
        if output.outputs.finish_reason in ("stop", "length") and output.error_code == 200:
            self.success.inc()
        if m.time_in_queue is not None:
            self.queue.observe(m.time_in_queue)
        if m.first_token_time is None:
            return  # never produced a token (aborted in the queue, or failed)
        # FastDeploy's meanings: first_token_time and model_forward_time are durations from inference_start_time.
        ttft = m.inference_start_time + m.first_token_time - m.arrival_time
        self.ttft.observe(ttft)
        self.prefill.observe(m.first_token_time)
        if m.model_forward_time is not None:
            self.inference.observe(m.model_forward_time)
            self.decode.observe(m.model_forward_time - m.first_token_time)
            if m.model_forward_time > 0:
                self.token_ratio.observe(generated / m.model_forward_time)
        if m.model_execute_time is not None:
            self.e2e.observe(m.model_execute_time)
            if generated > 1:
                self.tpot.observe((m.model_execute_time - ttft) / (generated - 1))
