"""`fastdeploy chat` and `fastdeploy complete`: small clients of a running OpenAI-compatible server
(this package's or any other), streaming the answer to stdout. Plain `requests` (a runtime dependency):
the official `openai` client is only a test dependency of this package."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import requests

DEFAULT_URL = "http://127.0.0.1:8000/v1"  # the server's default --host and --port
# Seconds to connect, and between two streamed chunks (a long prefill on a busy CPU server can take a while).
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0


class ClientError(Exception):
    """A failure to report to the user in one line (exit status 1)."""


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help="the server's OpenAI API base URL (default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="model name to send (default: the first model listed by GET /v1/models)")
    parser.add_argument("--api-key", default=None,
                        help="sent as `Authorization: Bearer KEY` (for a server started with --api-key)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="most tokens to generate per answer (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature; 0 is greedy (default: the server's)")
    parser.add_argument("-q", "--quick", metavar="TEXT", default=None,
                        help="send TEXT once, print the answer and exit (no reading of stdin)")


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser(
        "chat", help="chat with a running server (interactive)",
        description="Chat with a running OpenAI-compatible server through /v1/chat/completions: each line read "
                    "from stdin is a user message, the streamed answer is printed; the conversation is kept "
                    "until EOF (Ctrl-D).")
    _add_common(chat)
    chat.add_argument("--system-prompt", default=None, help="a system message that opens the conversation")
    complete = subparsers.add_parser(
        "complete", help="complete prompts on a running server",
        description="Complete text through a running OpenAI-compatible server's /v1/completions: the prompt of "
                    "--prompt (or --quick), else each line read from stdin until EOF; the streamed completion "
                    "is printed.")
    _add_common(complete)
    complete.add_argument("--prompt", default=None, help="complete this prompt once and exit")


class Client:
    def __init__(self, url: str, api_key: str | None):
        self.url = url.rstrip("/")
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        try:
            response = self.session.request(method, self.url + path, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
                                            **kwargs)
        except requests.ConnectionError as e:
            raise ClientError(f"cannot reach the server at --url {self.url}: {e}") from None
        if response.status_code != 200:
            raise ClientError(f"{method} {self.url + path}: HTTP {response.status_code}: {_error_message(response)}")
        return response

    def first_model(self) -> str:
        models = self._request("GET", "/models").json().get("data") or []
        if not models:
            raise ClientError(f"{self.url}/models lists no model; pass --model")
        return models[0]["id"]

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        """The text pieces of a streamed answer, as the server sends them (server-sent events)."""
        with self._request("POST", path, json={**body, "stream": True}, stream=True) as response:
            for line in response.iter_lines(decode_unicode=False):
                if not line.startswith(b"data: "):
                    continue  # blank separators, comments
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ClientError(f"the server failed mid-answer: {event['error'].get('message')}")
                for choice in event.get("choices", ()):
                    piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                    if piece:
                        yield piece


def _error_message(response: requests.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {name: value for name, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature))
            if value is not None}


def _print_stream(pieces: Iterator[str], out: TextIO) -> str:
    text = []
    for piece in pieces:
        out.write(piece)
        out.flush()
        text.append(piece)
    out.write("\n")
    out.flush()
    return "".join(text)


def _inputs(quick: str | None, stdin: TextIO) -> Iterator[str]:
    """--quick's text alone, else stdin's lines (a "> " prompt only when a person is typing)."""
    if quick is not None:
        yield quick
        return
    while True:
        if stdin.isatty():
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = stdin.readline()
        if not line:  # EOF
            return
        line = line.rstrip("\n")
        if line.strip():
            yield line


def run_chat(args: argparse.Namespace) -> int:
    client = Client(args.url, args.api_key)
    try:
        model = args.model or client.first_model()
        messages: list[dict[str, str]] = []
        if args.system_prompt:
            messages.append({"role": "system", "content": args.system_prompt})
        for line in _inputs(args.quick, sys.stdin):
            messages.append({"role": "user", "content": line})
            answer = _print_stream(client.stream("/chat/completions",
                                                 {"model": model, "messages": messages, **_sampling(args)}),
                                   sys.stdout)
            messages.append({"role": "assistant", "content": answer})
    except ClientError as e:
        print(f"fastdeploy chat: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C ends the session like Ctrl-D, without a traceback
        print()
        return 130
    return 0


def run_complete(args: argparse.Namespace) -> int:
    if args.prompt is not None and args.quick is not None:
        print("fastdeploy complete: error: give --prompt or --quick, not both", file=sys.stderr)
        return 2
    client = Client(args.url, args.api_key)
    once = args.prompt if args.prompt is not None else args.quick
    try:
        model = args.model or client.first_model()
        for prompt in _inputs(once, sys.stdin):
            _print_stream(client.stream("/completions", {"model": model, "prompt": prompt, **_sampling(args)}),
                          sys.stdout)
    except ClientError as e:
        print(f"fastdeploy complete: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print()
        return 130
    return 0
