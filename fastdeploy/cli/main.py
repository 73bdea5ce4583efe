"""The `fastdeploy` command's entry point: the sub-command parsers and the dispatch to their modules.

    fastdeploy serve MODEL [flags]          the OpenAI-compatible server (its own flags)
    fastdeploy chat | complete [flags]      clients of a running server
    fastdeploy bench latency|throughput|serve [script flags]
    fastdeploy run-batch -i in.jsonl -o out.jsonl --model MODEL [engine flags]
    fastdeploy collect-env
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastdeploy.cli import bench, client, collect_env, run_batch, serve
from fastdeploy.utils import current_package_version


def make_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command's parser, and the sub-parsers that validate further after parsing (by name)."""
    parser = argparse.ArgumentParser(
        prog="fastdeploy", description="FastDeploy-compatible LLM inference on CPU: serve a model over the OpenAI "
                                       "API, talk to a server, benchmark, run batch files, report the environment.",
        epilog="`fastdeploy COMMAND --help` lists a command's flags; docs/cli.md has examples.")
    parser.add_argument("-v", "--version", action="version", version=f"%(prog)s {current_package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve.add_parser(commands)
    client.add_parsers(commands)
    bench.add_parser(commands)
    batch = run_batch.add_parser(commands)
    collect_env.add_parser(commands)
    return parser, {"run-batch": batch}


def main(argv: Sequence[str] | None = None) -> None:
    args_in = list(sys.argv[1:] if argv is None else argv)
    # Two commands hand their words on untouched, before argparse reads them: `bench KIND ...` (the script's own
    # flags, --help included) and `serve ...` (the server parses them again itself; only a leading MODEL is
    # rewritten to --model).
    if args_in[:1] == ["bench"] and len(args_in) > 1 and args_in[1] in bench.SCRIPTS:
        sys.exit(bench.run(args_in[1], args_in[2:]))
    if args_in[:1] == ["serve"]:
        args_in = ["serve", *serve.model_first(args_in[1:])]
    parser, sub = make_parser()
    args = parser.parse_args(args_in)  # for serve: its flags are checked here, with `fastdeploy serve` errors
    if args.command == "serve":
        sys.exit(serve.run(args_in[1:]))
    if args.command == "chat":
        sys.exit(client.run_chat(args))
    if args.command == "complete":
        sys.exit(client.run_complete(args))
    if args.command == "run-batch":
        sys.exit(run_batch.run(args, sub["run-batch"]))
    if args.command == "collect-env":
        sys.exit(collect_env.run(args))
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse checks the choices


if __name__ == "__main__":
    main()
