"""The server's Prometheus metrics (issue 43, point 6): every `fastdeploy:*` name docs/online_serving.md lists is
exported with its documented type, and after a known set of requests the counters, histograms and gauges hold
what those requests were (token counts, max_tokens, prefix-cache hits, the KV pool at rest)."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from tests.test_api_server import TIMEOUT_S, Server

ROOT = Path(__file__).resolve().parent.parent
BLOCKS, MAX_NUM_SEQS = 40, 4
TYPES = {"counter", "gauge", "histogram"}
SPECULATIVE = "fastdeploy:spec_decode_"  # the metrics a server has only with a speculative_config


def documented(speculative: bool = False) -> dict[str, str]:
    """{exposed name: type} from the metrics tables of docs/online_serving.md: those of every server, and with
    `speculative` those of speculative decoding as well."""
    section = (ROOT / "docs" / "online_serving.md").read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(fastdeploy:[a-z0-9_]+)` \| (\w+) \|", section, re.M)
    return {name: kind for name, kind in rows if speculative or not name.startswith(SPECULATIVE)}


def exported_families(server: Server) -> dict[str, str]:
    """{family: type} the server exports; prometheus_client's `_created` gauge beside each counter and histogram
    is its own, not a metric here."""
    types, _ = scrape(server)
    return {name: kind for name, kind in types.items() if not name.endswith("_created")}


def scrape(server: Server) -> tuple[dict[str, str], dict[str, float]]:
    """({family: type} from the # TYPE lines, {sample with labels: value})."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    types = dict(re.findall(r"^# TYPE (fastdeploy:\S+) (\w+)$", text, re.M))
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("fastdeploy:")}
    return types, samples


@pytest.fixture(scope="module")
def server(tiny_hf: str):
    s = Server(tiny_hf, "--num-gpu-blocks-override", str(BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
               "--block-size", "16")
    yield s
    assert s.stop() == 0


def complete(server: Server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S,
                   json={"temperature": 0, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_every_documented_metric_is_exported_with_its_type(server: Server) -> None:
    table = documented()
    assert len(table) >= 30 and set(table.values()) <= TYPES
    exported = exported_families(server)
    assert exported == table
    # Without a speculative_config the speculative metrics are not registered at all (FastDeploy's rule).
    assert len(documented(speculative=True)) == len(table) + 4
    assert not [name for name in exported if name.startswith(SPECULATIVE)]


def test_values_follow_the_requests(server: Server) -> None:
    _, before = scrape(server)
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16 to cache
    usages = [complete(server, prompt=prompt, max_tokens=5)["usage"],
              complete(server, prompt=prompt, max_tokens=7)["usage"],  # the same prefix: a cache hit
              complete(server, prompt=[3, 4, 5], max_tokens=3, n=2)["usage"]]
    _, after = scrape(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("fastdeploy:requests_number_total") == 4
    assert grew("fastdeploy:request_success_total") == 4
    assert grew("fastdeploy:prompt_tokens_total") == 40 + 40 + 3 + 3
    assert grew("fastdeploy:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 5 + 7 + 6
    assert grew("fastdeploy:request_params_max_tokens_sum") == 5 + 7 + 3 + 3
    assert grew("fastdeploy:request_generation_tokens_sum") == 18
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_inference_time_seconds", "request_queue_time_seconds",
                      "request_prompt_tokens", "request_token_ratio"):
        assert grew(f"fastdeploy:{histogram}_count") == 4, histogram
    assert grew("fastdeploy:prefix_cache_token_num_total") == 32  # the second call's two full blocks
    assert after["fastdeploy:hit_token_rate"] > 0 and 0 < after["fastdeploy:hit_req_rate"] < 1
    # The pool at rest: nothing held, the cached prefix still there until evicted.
    assert after["fastdeploy:max_gpu_block_num"] == after["fastdeploy:available_gpu_block_num"] == BLOCKS
    assert after["fastdeploy:free_gpu_block_num"] <= BLOCKS - 2
    assert after["fastdeploy:available_gpu_resource"] == 1 and after["fastdeploy:gpu_cache_usage_perc"] == 0
    assert after["fastdeploy:max_batch_size"] == MAX_NUM_SEQS == after["fastdeploy:available_batch_size"]
    assert after['fastdeploy:cache_config_info{block_size="16",cache_dtype="bfloat16",enable_prefix_caching="True",'
                 'kv_cache_ratio="0.75"}'] == 1
