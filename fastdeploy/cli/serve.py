"""`fastdeploy serve [MODEL] [flags]`: the OpenAI-compatible server with exactly its own flags
(fastdeploy.entrypoints.openai.cli_args); the model may come first as a positional, as `vllm serve MODEL`."""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from fastdeploy.entrypoints.openai.cli_args import make_parser

DESCRIPTION = ("Start the OpenAI-compatible API server (/v1/chat/completions, /v1/completions, /v1/models, /health, "
               "/metrics) on one engine. The flags are the server's: `python -m "
               "fastdeploy.entrypoints.openai.api_server --help` lists the same ones.")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # The server's parser is the parent, so its flags, defaults and help are this command's without a copy
    # that could drift; -h comes from the parent too.
    return subparsers.add_parser(
        "serve", parents=[make_parser()], add_help=False, help="start the OpenAI-compatible API server",
        description=DESCRIPTION, usage="%(prog)s [MODEL] [--model MODEL] [options] (see --help)")


def model_first(argv: Sequence[str]) -> list[str]:
    """`serve` arguments with a leading positional MODEL turned into `--model MODEL` (argparse's positional
    would also swallow a stray word elsewhere; as vLLM's, the model tag goes first)."""
    args = list(argv)
    if args and not args[0].startswith("-"):
        if "--model" in args[1:] or any(a.startswith("--model=") for a in args[1:]):
            raise SystemExit(f"fastdeploy serve: error: the model is given twice: as MODEL ({args[0]!r}) and as "
                             "--model; give one")
        return ["--model", args[0], *args[1:]]
    return args


def run(argv: Sequence[str]) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a graceful stop (the server exits 1 itself if it never started)."""
    from fastdeploy.entrypoints.openai import api_server  # uvicorn and the engine: only when serving

    api_server.main(list(argv))
    return 0
