"""`--data-parallel-size 2`: two engines behind one port (entrypoints/openai/data_parallel.py). Both get work, the
answers (whole and streamed) are the one-engine server's, /metrics has each engine's counters, /health follows the
engines, and an engine that dies stops the front with status 1."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest
from test_api_server import KEY, Server

from fastdeploy.entrypoints.openai.data_parallel import engine_argv, merged_metrics

PROMPTS = [f"Story {i}: once upon a time" for i in range(8)]


@pytest.fixture(scope="module")
def servers(tiny_hf):
    flags = ("--api-key", KEY, "--max-num-seqs", "4", "--served-model-name", "tiny")
    one, two = Server(tiny_hf, *flags), Server(tiny_hf, *flags, "--data-parallel-size", "2")
    yield one, two
    assert one.stop() == 0
    assert two.stop() == 0


def complete(server: Server, prompt: str, stream: bool) -> tuple[str, list[int] | None]:
    client = server.client()
    if not stream:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True})
        return r.choices[0].text, r.choices[0].completion_token_ids
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices), None


def test_both_engines_work_and_answers_equal_one_engines(servers) -> None:
    one, two = servers
    for stream in (False, True):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: complete(two, p, stream), PROMPTS))
        assert got == [complete(one, p, stream) for p in PROMPTS]
    finished = {k: v for k, v in two.metrics().items() if k.startswith("fastdeploy:request_success_total")}
    assert set(finished) == {'fastdeploy:request_success_total{dp_rank="0"}',
                             'fastdeploy:request_success_total{dp_rank="1"}'}
    assert sum(finished.values()) == 2 * len(PROMPTS) and min(finished.values()) > 0


def test_keys_and_errors_are_the_engines(servers) -> None:
    _, two = servers
    r = httpx.post(f"{two.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.post(f"{two.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "prompt": "x", "max_tokens": -1}, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert httpx.get(f"{two.url}/health", timeout=10).json() == {"status": "ok", "data_parallel_size": 2}


def test_a_dead_engine_stops_the_front(tiny_hf) -> None:
    server = Server(tiny_hf, "--data-parallel-size", "2")
    try:
        engines = [c for c in _children(server.proc.pid)]
        assert len(engines) == 2
        os.kill(engines[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.returncode == 1
        time.sleep(1)
        assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in engines)
    finally:
        server.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _alive(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_engines_stop_when_the_front_is_killed(tiny_hf) -> None:
    server = Server(tiny_hf, "--data-parallel-size", "2")
    engines = _children(server.proc.pid)
    server.proc.kill()
    server.proc.wait()
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in engines)


def test_engine_flags_leave_out_the_fronts_own() -> None:
    argv = ["--model", "m", "--port", "80", "--host=0.0.0.0", "--data-parallel-size", "2", "--api-key", "k"]
    assert engine_argv(argv, 1234) == ["--model", "m", "--api-key", "k", "--host", "127.0.0.1", "--port", "1234"]


def test_metrics_are_merged_with_each_engines_rank() -> None:
    text = '# HELP fastdeploy:x_total X\n# TYPE fastdeploy:x_total counter\nfastdeploy:x_total 3.0\n'
    merged = merged_metrics([text, text.replace("3.0", "4.0")]).decode()
    assert 'fastdeploy:x_total{dp_rank="0"} 3.0' in merged and 'fastdeploy:x_total{dp_rank="1"} 4.0' in merged
    assert merged.count("# TYPE fastdeploy:x_total counter") == 1
