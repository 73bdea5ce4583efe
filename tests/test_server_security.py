"""The server's trust boundary (docs/security.md, issue 41): a real server on 127.0.0.1, driven as a client
would drive it. Request-supplied chat templates are refused by default, never read as a file, and bounded
when the operator trusts them."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_api_server import MESSAGES, TIMEOUT_S, Server

SECRET = "s3cr3t-do-not-leak-41"
BOMB = "{{ 'x' * 10**9 }}"


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "template.jinja"
    # A valid template: were it read, the rendered prompt (and its token ids) would carry the secret.
    path.write_text(f"{SECRET}{{% for m in messages %}}{{{{ m['content'] }}}}{{% endfor %}}")
    return path


@pytest.fixture(scope="module")
def default_server(tiny_hf: str):
    s = Server(tiny_hf)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def trusting_server(tiny_hf: str):
    s = Server(tiny_hf, "--trust-request-chat-template", "--served-model-name", "tiny",
               "--enable-prompt-tokens-details")
    yield s
    assert s.stop() == 0


def chat(server: Server, **extra: Any) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "return_token_ids": True, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_answers(server: Server, **extra: Any) -> dict[str, Any]:
    r = chat(server, **extra)
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------ request chat templates


@pytest.mark.parametrize("where", ["chat_template", "chat_template_kwargs"])
def test_request_template_refused_by_default(default_server, secret_file, where):
    extra = ({"chat_template": str(secret_file)} if where == "chat_template"
             else {"chat_template_kwargs": {"chat_template": str(secret_file), "enable_thinking": False}})
    r = chat(default_server, **extra)
    field = "chat_template" if where == "chat_template" else "chat_template_kwargs.chat_template"
    error = assert_openai_error(r, 400, field)
    assert "--trust-request-chat-template" in error["message"]
    assert SECRET not in r.text and str(secret_file) not in r.text  # not even whether the path exists
    # an existing file and a missing one get the same answer: nothing tells whether a path exists
    for path in ("/etc/hostname", "/nonexistent/x.jinja"):
        other = chat(default_server, **{k: (v if k == "chat_template" else {**v, "chat_template": path})
                                        if isinstance(v, dict) else path for k, v in extra.items()})
        assert assert_openai_error(other, 400, field)["message"] == error["message"]
    assert_answers(default_server)


def test_trusted_template_is_text_never_a_file(trusting_server, secret_file):
    plain = assert_answers(trusting_server)
    for extra in ({"chat_template": str(secret_file)},
                  {"chat_template_kwargs": {"chat_template": str(secret_file)}}):
        r = chat(trusting_server, **extra)
        assert r.status_code == 200, r.text
        assert SECRET not in r.text
        ids = r.json()["choices"][0]["message"]["prompt_token_ids"]
        assert ids != plain["choices"][0]["message"]["prompt_token_ids"]  # the path's text was the template
        echoed = httpx.post(f"{trusting_server.url}/v1/completions", timeout=TIMEOUT_S,
                            json={"prompt": ids, "max_tokens": 1, "echo": True}).json()
        text = echoed["choices"][0]["text"]
        assert str(secret_file) in text and SECRET not in text
    # a real template string still works when trusted
    r = chat(trusting_server, chat_template="{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    assert r.status_code == 200, r.text
    # what real templates do stays allowed: JSON, indentation, wrapping, formatting, repetition, `~`
    busy = ("{{ messages|tojson(indent=2)|indent(4) }}{{ ('word ' * 6)|wordwrap(12) }}{{ '%s: %d'|format('n', 3) }}"
            "{{ '{}-{}'.format(1, 2) }}{{ '=' * 8 }}{% for m in messages %}{{ m.role ~ ': ' ~ m.content }}{% endfor %}")
    r = chat(trusting_server, chat_template=busy, max_tokens=1)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("bomb", [
    BOMB,
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'x'.center(10**9) }}",
    "{{ 7 ** (10 ** 9) }}",
    "{{ ([1] * 1000000)|tojson(indent=100000) }}",
    "{{ '{0:>{1}}'.format('x', 10 ** 9) }}",
])
def test_trusted_template_bombs_are_refused(trusting_server, bomb):
    started = time.monotonic()
    r = chat(trusting_server, chat_template_kwargs={"chat_template": bomb})
    assert_openai_error(r, 400, "chat_template_kwargs.chat_template")
    assert time.monotonic() - started < 30
    assert assert_answers(trusting_server)["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{trusting_server.url}/health", timeout=10).status_code == 200


def test_slow_template_stops_at_the_deadline(trusting_server):
    started = time.monotonic()
    loops = "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"
    r = chat(trusting_server, chat_template=loops)
    error = assert_openai_error(r, 400, "chat_template")
    assert "took longer" in error["message"]
    assert time.monotonic() - started < 30
    assert_answers(trusting_server)


# ------------------------------------------------------------------------ HTTP surface


def test_post_that_is_not_json_gets_415(default_server):
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = httpx.post(f"{default_server.url}/v1/chat/completions", content=body, headers=headers, timeout=TIMEOUT_S)
        assert_openai_error(r, 415)
    # the same body declared as JSON (with a charset) is served
    r = httpx.post(f"{default_server.url}/v1/chat/completions", content=body, timeout=TIMEOUT_S,
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_404_and_405_in_openai_shape(default_server):
    r = httpx.get(f"{default_server.url}/v1/no-such-route", timeout=10)
    assert "detail" not in r.json()
    assert_openai_error(r, 404)
    r = httpx.get(f"{default_server.url}/v1/chat/completions", timeout=10)
    assert "detail" not in r.json()
    assert assert_openai_error(r, 405)["type"] == "invalid_request_error"
    assert "POST" in r.headers.get("allow", "")


def test_models_do_not_reveal_the_model_path(default_server, trusting_server, tiny_hf):
    absolute = str(Path(tiny_hf).resolve())
    listed = httpx.get(f"{default_server.url}/v1/models", timeout=10)
    assert listed.status_code == 200 and absolute not in listed.text and tiny_hf not in listed.text
    (model,) = listed.json()["data"]
    assert model["id"] == model["root"] == Path(tiny_hf).name
    answer = assert_answers(default_server, model=model["id"])
    assert answer["model"] == model["id"] and absolute not in str(answer)
    assert_answers(default_server, model=tiny_hf)  # the --model argument as typed still names it
    (model,) = httpx.get(f"{trusting_server.url}/v1/models", timeout=10).json()["data"]
    assert model["id"] == model["root"] == "tiny"  # the operator's chosen name


def test_api_key_file(tmp_path):
    from fastdeploy.entrypoints.openai.cli_args import api_keys, make_parser

    keys = tmp_path / "keys"
    keys.write_text("\n  first-key  \n\nsecond-key\n")
    args = make_parser().parse_args(["--model", "m", "--api-key", "cli-key", "--api-key-file", str(keys)])
    assert api_keys(args) == ["cli-key", "first-key", "second-key"]
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        if bad.name == "empty":
            bad.write_text("\n \n")
        with pytest.raises(ValueError, match="--api-key-file"):
            api_keys(make_parser().parse_args(["--model", "m", "--api-key-file", str(bad)]))


def test_cached_tokens_only_when_enabled(default_server, trusting_server):
    prompt = "The same long prefix, sent twice. " * 8  # over one 64-token block
    for server, reported in ((default_server, False), (trusting_server, True)):
        for _ in range(2):
            r = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S,
                           json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
        assert ("prompt_tokens_details" in r.json()["usage"]) == reported
        assert "cached_tokens" in r.text if reported else "cached_tokens" not in r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the second of the trusting server


def test_cache_salt_keeps_prefix_hits_within_a_salt(trusting_server):
    prompt = "A prefix two tenants both send, long enough to fill a block. " * 6

    def cached(**salt: str) -> int:
        r = httpx.post(f"{trusting_server.url}/v1/completions", timeout=TIMEOUT_S,
                       json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **salt})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0  # the same tenant hits its own prefix
    assert cached(cache_salt="tenant-b") == 0  # another tenant does not, nor learns it was sent
    assert cached() == 0  # nor does an unsalted request
    r = chat(trusting_server, cache_salt="")
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
