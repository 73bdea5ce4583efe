"""The server's command line: every EngineArgs field (the LLM(...) parameters) as a --kebab-case flag
(same default, same validation: the values go to EngineArgs.create_engine_config), plus the server's own flags."""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from fastdeploy.config import EngineConfig
from fastdeploy.engine.args_utils import ENGINE_FIELDS, EngineArgs


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


_TYPES = {"int": int, "float": float, "str": str}


def _add_engine_flag(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    flag = "--" + f.name.replace("_", "-")
    base = str(f.type).replace(" | None", "")
    kwargs: dict[str, Any] = {"help": f.metadata.get("help", ""), "dest": f.name}
    if f.default is dataclasses.MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = f.default
        kwargs["help"] += " (default: %(default)s)"
    if f.metadata.get("cli_type") is not None:
        kwargs["type"] = f.metadata["cli_type"]
    elif base == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif base.startswith("dict"):
        kwargs["type"] = _json_object
    else:
        kwargs["type"] = _TYPES[base]
    group.add_argument(flag, **kwargs)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastdeploy.entrypoints.openai.api_server",
        description="OpenAI-compatible API server (chat and text completions, /metrics) on one engine.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="API port (default: %(default)s)")
    server.add_argument("--metrics-port", type=int, default=None,
                        help="serve /metrics on this port (default: on the API port)")
    server.add_argument("--api-key", action="append", default=None,
                        help="accept only `Authorization: Bearer KEY` on /v1 (repeat for several keys)")
    server.add_argument("--max-concurrency", type=int, default=None,
                        help="API calls served at once; more get HTTP 429 (default: unlimited)")
    server.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds running requests may take to finish (default: %(default)s)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = parser.add_argument_group("engine (the LLM(...) parameters)")
    for f in ENGINE_FIELDS:
        _add_engine_flag(engine, f)
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The validated EngineConfig of the parsed flags (ValueError/TypeError/NotImplementedError as LLM())."""
    return EngineArgs.from_cli_args(args).create_engine_config()
