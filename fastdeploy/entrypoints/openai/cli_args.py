"""The server's command line: every EngineArgs field (the LLM(...) parameters) as a --kebab-case flag
(same default, same validation: the values go to EngineArgs.create_engine_config), the server's own flags, and
FastDeploy's parameters this engine does not implement (fastdeploy/not_implemented_args.py): accepted at
FastDeploy's default, any other value stops the server at start-up naming the flag."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from fastdeploy.config import EngineConfig
from fastdeploy.engine.args_utils import ENGINE_FIELDS, EngineArgs
from fastdeploy.entrypoints.openai.serving import RequestLimits
from fastdeploy.input.media import FETCH_TIMEOUT_S, MAX_FETCH_BYTES, MAX_IMAGE_PIXELS, MediaPolicy
from fastdeploy.not_implemented_args import NOT_IMPLEMENTED, refuse_not_implemented

# FastDeploy's LLM keywords `port` and `metrics_port` are this server's own --port / --metrics-port (honoured), and
# `data_parallel_size` its --data-parallel-size (engines behind the port, data_parallel.py).
SERVER_OWN = frozenset({"port", "metrics_port", "data_parallel_size"})
NOT_IMPLEMENTED_FLAGS = [name for name in NOT_IMPLEMENTED if name not in SERVER_OWN]
# The server's media limit per prompt when --limit-mm-per-prompt is not given (offline LLM has none).
SERVER_LIMIT_MM_PER_PROMPT = {"image": 16, "video": 2}
# POST bodies over this get 413. Under the 64 MiB test body; a data: URL (base64, 4/3 of the bytes) of
# an image up to ~24 MiB fits; larger media go by URL, or raise the flag with --max-media-bytes.
MAX_REQUEST_BODY_BYTES = 32 << 20
# FastDeploy's command-line forms that the default's type does not give: a list of class names, a tri-state switch.
_FORMS: dict[str, dict[str, Any]] = {"logits_processors": {"nargs": "+"},
                                     "shutdown_comm_group_if_worker_idle": {"action": argparse.BooleanOptionalAction}}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


_TYPES = {"int": int, "float": float, "str": str}


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _seconds(text: str) -> float:
    value = _number(text)
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return float(value)


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


def _add_not_implemented_flag(group: argparse._ArgumentGroup, name: str) -> None:
    default = NOT_IMPLEMENTED[name]
    kwargs: dict[str, Any] = {"dest": name, "default": default,
                              "help": f"FastDeploy's; only its default {default!r} is accepted here"}
    if name in _FORMS:
        kwargs.update(_FORMS[name])
    elif isinstance(default, bool):  # FastDeploy's forms: --flag for a switch that is off, --no-flag for one on
        kwargs["action"] = "store_true" if not default else argparse.BooleanOptionalAction
    elif isinstance(default, (int, float)):
        kwargs["type"] = _number
    else:  # str, or None: then any value given is refused, whatever its text
        kwargs["type"] = str
    group.add_argument("--" + name.replace("_", "-"), **kwargs)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastdeploy.entrypoints.openai.api_server",
        usage="%(prog)s --model MODEL [options] (see --help)",  # the full usage would bury an error's message
        description="OpenAI-compatible API server (chat and text completions, /metrics) on one engine.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="API port (default: %(default)s)")
    server.add_argument("--metrics-port", type=int, default=None,
                        help="serve /metrics on this port (default: on the API port)")
    server.add_argument("--data-parallel-size", type=int, default=1,
                        help="engines behind this port, each a process on its share of the cores, calls going to "
                             "the least busy (default: %(default)s)")
    server.add_argument("--api-key", action="append", default=None,
                        help="accept only `Authorization: Bearer KEY` on /v1 (repeat for several keys)")
    server.add_argument("--api-key-file", action="append", default=None, metavar="FILE",
                        help="read API keys from FILE, one per line (keeps them out of `ps` and the shell history); "
                             "adds to --api-key")
    server.add_argument("--max-concurrency", type=int, default=512,
                        help="API calls served at once; more get HTTP 429 (FastDeploy's default: %(default)s)")
    limits = RequestLimits()
    server.add_argument("--max-n", type=int, default=limits.max_n,
                        help="largest n / best_of of a request; more is HTTP 400 (default: %(default)s)")
    server.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings,
                        help="stop strings, and bad words, a request may send; more is HTTP 400 (default: %(default)s)")
    server.add_argument("--max-stop-string-chars", type=int, default=limits.max_stop_string_chars,
                        help="characters one stop string or bad word may have; more is HTTP 400 "
                             "(default: %(default)s)")
    server.add_argument("--max-prompts", type=int, default=limits.max_prompts,
                        help="prompts one /v1/completions call may send; more is HTTP 400 (default: %(default)s)")
    server.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES,
                        help="bytes a POST body may have; more get HTTP 413, a chunked body as soon as it passes "
                             "the limit (default: %(default)s)")
    server.add_argument("--max-waiting-time", type=_seconds, default=-1,
                        help="seconds a request may wait for a seat in the running batch; one still waiting then "
                             "fails with HTTP 408 (negative: no limit) (default: %(default)s)")
    server.add_argument("--timeout-graceful-shutdown", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds running requests may take to finish (default: %(default)s)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests send their own chat template (Jinja text, never a file path; rendered "
                             "within size and time limits); without it a request carrying one gets HTTP 400")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report prefix-cache hits in usage.prompt_tokens_details.cached_tokens (they tell a "
                             "client whether a prompt prefix was sent before, by anyone)")
    media = parser.add_argument_group("media (ERNIE-4.5-VL; docs/security.md)")
    media.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="let requests name local files (paths, file://) whose real path, symlinks resolved, "
                            "lies inside DIR (default: local files refused)")
    media.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="http(s) media and their redirects only from these host names (default: any host "
                            "whose addresses are public, not loopback, private or link-local)")
    media.add_argument("--max-media-bytes", type=int, default=MAX_FETCH_BYTES,
                       help="bytes one image or video may have, however it is given (default: %(default)s)")
    media.add_argument("--media-fetch-timeout", type=float, default=FETCH_TIMEOUT_S,
                       help="seconds one http(s) media download may take in total, redirects included "
                            "(default: %(default)s)")
    media.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                       help="width x height an image may have, checked before decoding (default: %(default)s)")
    media.add_argument("--max-video-frames", type=int, default=180,
                       help="largest max_frames / min_frames / target_frames a request's video may ask for "
                            "(default: %(default)s)")
    media.add_argument("--max-video-fps", type=float, default=2.0,
                       help="largest fps a request's video may ask for (default: %(default)s)")
    # FastDeploy's server flags for what it runs around its engine; their defaults describe this server.
    server.add_argument("--workers", type=int, default=1,
                        help="HTTP processes in front of the engine: only 1 here (one process serves every client "
                             "and steps the engine); more stops the server at start-up (default: %(default)s)")
    server.add_argument("--controller-port", type=int, default=-1,
                        help="FastDeploy's scheduler-control API port; there is no such API here, so only -1 (off) "
                             "is accepted (default: %(default)s)")
    server.add_argument("--enable-mm-output", action="store_true",
                        help="FastDeploy's multimodal_content in responses; no model here outputs media, so it "
                             "is refused when given")
    server.add_argument("--timeout", type=int, default=0,
                        help="FastDeploy's gunicorn worker timeout (restart an HTTP worker silent this many "
                             "seconds); there is no such worker here, so only 0 (off) is accepted "
                             "(default: %(default)s)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = parser.add_argument_group("engine (the LLM(...) parameters)")
    for f in ENGINE_FIELDS:
        _add_engine_flag(engine, f)
    fastdeploy_only = parser.add_argument_group(
        "FastDeploy parameters not implemented by this CPU engine (fastdeploy/not_implemented_args.py)")
    for name in NOT_IMPLEMENTED_FLAGS:
        _add_not_implemented_flag(fastdeploy_only, name)
    return parser


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of --api-key and of each --api-key-file (ValueError for a file that cannot be read or holds none)."""
    keys = list(args.api_key or ())
    for file in args.api_key_file or ():
        try:
            with open(file, encoding="utf-8") as f:
                found = [line.strip() for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {file}: cannot be read ({e})") from None
        if not found:
            raise ValueError(f"--api-key-file {file}: holds no key")
        keys += found
    return keys


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The validated EngineConfig of the parsed flags (ValueError/TypeError/NotImplementedError as LLM(); a
    FastDeploy-only flag away from its default is a NotImplementedError naming it)."""
    for name in NOT_IMPLEMENTED_FLAGS:
        try:
            refuse_not_implemented({name: getattr(args, name)})
        except NotImplementedError as e:
            raise NotImplementedError(f"--{name.replace('_', '-')}: {e}") from None
    return EngineArgs.from_cli_args(args).create_engine_config()


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """The server's MediaPolicy of the media flags (ValueError naming a bad one)."""
    return MediaPolicy(allowed_local_media_path=args.allowed_local_media_path,
                       allowed_media_domains=tuple(args.allowed_media_domains)
                       if args.allowed_media_domains is not None else None,
                       max_bytes=args.max_media_bytes, fetch_timeout=args.media_fetch_timeout,
                       max_image_pixels=args.max_image_pixels, limit_mm_per_prompt=SERVER_LIMIT_MM_PER_PROMPT,
                       max_video_frames=args.max_video_frames, max_video_fps=args.max_video_fps)


def check_fastdeploy_server_flags(args: argparse.Namespace) -> None:
    """FastDeploy's server flags at values this server cannot honour (ValueError naming the flag)."""
    if args.workers != 1:
        raise ValueError(f"--workers {args.workers}: this server runs one HTTP process, which also steps the engine "
                         "(several processes cannot share it); only --workers 1 is accepted")
    if args.controller_port != -1:
        raise ValueError(f"--controller-port {args.controller_port}: this server has no scheduler-control API "
                         "(FastDeploy's /controller/*); only -1 (off) is accepted")
    if args.enable_mm_output:
        raise ValueError("--enable-mm-output: no model served here outputs media, so responses never carry "
                         "multimodal_content; leave the flag out")
    if args.timeout != 0:
        raise ValueError(f"--timeout {args.timeout}: FastDeploy's gunicorn worker timeout (restart a silent HTTP "
                         "worker); this server has no such worker, so only 0 (off) is accepted. Bound how long a "
                         "request may wait for a seat with --max-waiting-time")


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The per-request limits of their flags (ValueError naming one below 1)."""
    for name in ("max_n", "max_stop_strings", "max_stop_string_chars", "max_prompts", "max_request_body_bytes",
                 "max_concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return RequestLimits(args.max_n, args.max_stop_strings, args.max_stop_string_chars, args.max_prompts)
