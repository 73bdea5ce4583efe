"""The server's per-request limits (issue 41, point 5; docs/security.md): a real server on 127.0.0.1 with
small --max-* flags (the body limit at its default, so the 64 MiB body is the issue's own test). Each limit
passed is refused before any work, in OpenAI's error shape, and a normal request succeeds after."""
from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fastdeploy.entrypoints.openai.cli_args import MAX_REQUEST_BODY_BYTES, make_parser, request_limits
from tests.test_api_server import MESSAGES, TIMEOUT_S, Server

MiB = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_hf: str):
    s = Server(tiny_hf, "--max-n", "2", "--max-stop-strings", "3", "--max-stop-string-chars", "8",
               "--max-prompts", "4")
    yield s
    assert s.stop() == 0


def post(server: Server, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=TIMEOUT_S)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param


def assert_healthy(server: Server) -> None:
    r = post(server, "chat/completions", messages=MESSAGES, max_tokens=2, temperature=0, n=2,
             stop=["a" * 8] * 3)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    r = post(server, "completions", prompt=["Hi"] * 4, max_tokens=2, temperature=0)
    assert r.status_code == 200, r.text


def test_defaults() -> None:
    args = make_parser().parse_args(["--model", "m"])
    assert args.max_concurrency == 512  # FastDeploy's
    assert args.max_request_body_bytes == MAX_REQUEST_BODY_BYTES == 32 * MiB
    assert args.max_request_body_bytes > 16 * MiB * 4 // 3  # a 16 MiB image fits as a data: URL
    assert (args.max_n, args.max_stop_strings, args.max_stop_string_chars, args.max_prompts) == (16, 16, 512, 256)


def test_body_over_the_limit_by_content_length(server: Server) -> None:
    body = json.dumps({"messages": MESSAGES, "stop": ["x" * (MAX_REQUEST_BODY_BYTES + 1)]})
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
    assert_error(r, 413)
    assert_healthy(server)


def _chunks(sent: list[int]) -> Iterator[bytes]:
    yield b'{"messages": [{"role": "user", "content": "'
    for _ in range(64):
        sent[0] += MiB
        yield b"x" * MiB
    yield b'"}]}'


def test_chunked_64_mib_body_gets_413(server: Server) -> None:
    sent = [0]  # no Content-Length: the server must count while it reads
    r = httpx.post(f"{server.url}/v1/chat/completions", content=_chunks(sent),
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
    assert_error(r, 413)
    assert_healthy(server)


def test_chunked_body_is_answered_before_it_ends(server: Server) -> None:
    """The 413 comes once the limit is passed, while the client is still sending: the server does not read
    (and buffer) the whole body first."""
    sent = [0]
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        answered_at = None
        for chunk in _chunks(sent):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if select.select([sock], [], [], 0.05)[0]:
                answered_at = sent[0]
                break
        assert answered_at is not None, "no answer before the whole 64 MiB body was sent"
        assert answered_at < 64 * MiB
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    assert_healthy(server)


@pytest.mark.parametrize("path,field,extra", [
    ("chat/completions", "n", {"n": 3}),
    ("completions", "n", {"n": 3}),
    ("completions", "best_of", {"best_of": 3, "n": 1}),
    ("chat/completions", "stop", {"stop": ["a", "b", "c", "d"]}),
    ("chat/completions", "stop", {"stop": "a" * 9}),
    ("completions", "stop", {"stop": ["ok", "b" * 9]}),
    ("chat/completions", "bad_words", {"bad_words": ["a", "b", "c", "d"]}),
    ("completions", "bad_words", {"bad_words": ["c" * 9]}),
    ("completions", "prompt", {"prompt": ["Hi"] * 5}),
    ("completions", "prompt", {"prompt": [[1, 2]] * 5}),
])
def test_over_a_limit_is_400_naming_the_field(server: Server, path: str, field: str, extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "temperature": 0}
    body.update({"messages": MESSAGES} if path == "chat/completions" else {"prompt": "Hi"})
    body.update(extra)
    assert_error(post(server, path, **body), 400, field)
    assert_healthy(server)


@pytest.mark.parametrize("flag", ["--max-n", "--max-stop-strings", "--max-stop-string-chars", "--max-prompts",
                                  "--max-request-body-bytes", "--max-concurrency"])
def test_a_limit_below_one_is_refused_at_start_up(flag: str) -> None:
    args = make_parser().parse_args(["--model", "m", flag, "0"])
    with pytest.raises(ValueError, match=flag):
        request_limits(args)
    assert request_limits(make_parser().parse_args(["--model", "m", flag, "1"])) is not None
