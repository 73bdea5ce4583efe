"""A client that leaves gives back what it held (issue 41, point 6; docs/security.md): a real server on
127.0.0.1 with --max-concurrency 2 and two seats in the batch (--max-num-seqs 2, a call waiting for one
under --max-waiting-time), requests long enough (tens of thousands of tokens) to run for many seconds
unless they are aborted. The gauges are the engine's own counts after each step."""
from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from tests.test_api_server import TIMEOUT_S, Server

LONG = 60000  # output tokens: well over 3 s of decoding on the tiny model
ABORT_WITHIN_S = 3.0


@pytest.fixture(scope="module")
def server(tiny_hf: str):
    s = Server(tiny_hf, "--max-model-len", str(LONG + 64), "--max-concurrency", "2", "--max-num-seqs", "2",
               "--max-waiting-time", "60")
    yield s
    assert s.stop() == 0


def send(server: Server, path: str, body: dict[str, Any]) -> socket.socket:
    """A raw connection with the request sent and nothing read: the caller decides when the client leaves."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S)
    sock.sendall(b"POST /v1/%s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(data), data))
    return sock


def long_body(path: str, **extra: Any) -> dict[str, Any]:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if path == "chat/completions" else {"prompt": [5, 6, 7]}
    return {**prompt, "max_tokens": LONG, "ignore_eos": True, "temperature": 0, **extra}


def wait_for(server: Server, ok, within: float) -> dict[str, float]:
    """The metrics once ok(metrics) holds; fails after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        m = server.metrics()
        if ok(m):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def running(m: dict[str, float]) -> float:
    return m["fastdeploy:num_requests_running"]


def assert_both_slots_free(server: Server) -> None:
    """Two calls at once under --max-concurrency 2 are both served (a leaked slot would make one a 429)."""
    with httpx.Client(timeout=TIMEOUT_S) as client:
        bodies = [{"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}] * 2
        with client.stream("POST", f"{server.url}/v1/completions", json=bodies[0]) as first, \
                client.stream("POST", f"{server.url}/v1/completions", json=bodies[1]) as second:
            assert (first.status_code, second.status_code) == (200, 200)
            assert all(b"[DONE]" in r.read() for r in (first, second))


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_a_whole_response_call_is_aborted_when_its_client_leaves(server: Server, path: str) -> None:
    before = server.metrics()
    sock = send(server, path, long_body(path, n=2))
    wait_for(server, lambda m: running(m) == 2, TIMEOUT_S)
    time.sleep(0.3)  # tokens are flowing: no gap in the outputs to notice the client's absence in
    sock.close()
    left = time.monotonic()
    after = wait_for(server, lambda m: running(m) == 0, ABORT_WITHIN_S)
    assert time.monotonic() - left < ABORT_WITHIN_S
    generated = after["fastdeploy:generation_tokens_total"] - before["fastdeploy:generation_tokens_total"]
    assert 0 < generated < 2 * LONG  # aborted part way, not run to max_tokens
    assert after["fastdeploy:request_success_total"] == before["fastdeploy:request_success_total"]
    assert_both_slots_free(server)


def test_streams_abandoned_before_their_first_byte_leave_the_slots_free(server: Server) -> None:
    before = server.metrics()
    for i in range(5):
        path = ("completions", "chat/completions")[i % 2]
        send(server, path, long_body(path, stream=True)).close()  # gone before reading a byte
    time.sleep(0.5)  # the server has taken the five in
    wait_for(server, lambda m: running(m) == 0 and m["fastdeploy:num_requests_waiting"] == 0, 2 * ABORT_WITHIN_S)
    assert_both_slots_free(server)
    after = server.metrics()
    # Whatever of the five reached the engine was aborted, long before its max_tokens.
    generated = after["fastdeploy:generation_tokens_total"] - before["fastdeploy:generation_tokens_total"]
    assert generated < LONG
    assert after["fastdeploy:request_success_total"] - before["fastdeploy:request_success_total"] == 2


def test_a_call_waiting_for_a_seat_is_aborted_when_its_client_leaves(server: Server) -> None:
    seated = send(server, "completions", long_body("completions", n=2))  # both seats
    wait_for(server, lambda m: running(m) == 2, TIMEOUT_S)
    waiting = send(server, "completions", long_body("completions", stream=True))
    wait_for(server, lambda m: m["fastdeploy:num_requests_waiting"] == 1, TIMEOUT_S)
    waiting.close()
    time.sleep(0.3)
    seated.close()
    # Had the waiting call stayed, it would take a seat as soon as the first call's were freed.
    wait_for(server, lambda m: running(m) == 0 and m["fastdeploy:num_requests_waiting"] == 0, ABORT_WITHIN_S)
    assert_both_slots_free(server)
