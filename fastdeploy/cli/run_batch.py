"""`fastdeploy run-batch -i in.jsonl -o out.jsonl --model M [engine flags]`: an OpenAI batch file run offline
in this process (batch_lines.py: the format; batch_engine.py: the run; batch_bodies.py: the responses)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fastdeploy.cli.batch_bodies import chat_body, completion_body
from fastdeploy.cli.batch_engine import BatchEngine, LineResult
from fastdeploy.cli.batch_lines import BatchRequest, LineFailure, failure_line, parse_line, response_line
from fastdeploy.engine.args_utils import ENGINE_FIELDS
from fastdeploy.entrypoints.openai.cli_args import engine_config, make_parser
from fastdeploy.entrypoints.openai.protocol import error_body
from fastdeploy.input.tokenizer import Tokenizer

# The server parser's groups whose flags run-batch takes: the LLM(...) parameters, and FastDeploy's ones this
# engine does not implement (refused away from their defaults, naming the flag, as the server refuses them).
_ENGINE_GROUPS = ("engine", "FastDeploy parameters")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The server's engine flags, the same Action objects (argparse's `parents` would bring its HTTP flags too,
    meaningless offline), so their names, defaults and checks cannot drift from `serve`'s."""
    source = make_parser()
    for group in source._action_groups:
        if group.title and group.title.startswith(_ENGINE_GROUPS):
            target = parser.add_argument_group(group.title, group.description)
            for action in group._group_actions:
                target._add_action(action)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch file offline (JSONL in, JSONL out)",
        description="Run the requests of an OpenAI batch file (one JSON line each: custom_id, method POST, url "
                    "/v1/chat/completions or /v1/completions, body) in this process on one engine, all in the "
                    "same continuous batch, and write OpenAI's batch output lines (id, custom_id, response, "
                    "error) in the input's order. A bad line gets its own error line; the others still run.",
        usage="%(prog)s -i INPUT.jsonl -o OUTPUT.jsonl --model MODEL [engine options] (see --help)")
    files = parser.add_argument_group("batch")
    files.add_argument("-i", "--input-file", required=True, type=Path, help="the batch file (JSONL) to run")
    files.add_argument("-o", "--output-file", required=True, type=Path,
                       help="where to write the results (JSONL, one line per input line; overwritten)")
    _add_engine_flags(parser)
    return parser


def _read_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each non-blank line."""
    try:
        with path.open(encoding="utf-8") as f:
            return [(number, text) for number, text in enumerate(f, 1) if text.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--input-file {path}: cannot be read ({e})") from None


def _output_line(result: LineResult | LineFailure, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    if isinstance(result, LineFailure):
        return failure_line(result)
    request = result.request
    if result.error is not None:
        status, message = result.error
        return response_line(request.custom_id, status, error_body(status, message))
    body = chat_body(result, model) if request.chat else completion_body(result, model, tokenizer)
    return response_line(request.custom_id, 200, body)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fastdeploy.entrypoints.llm import LLM
    from fastdeploy.entrypoints.openai.api_server import served_name

    try:
        config = engine_config(args)  # every engine flag checked, naming a bad one, before the model loads
        lines = _read_lines(args.input_file)
        if not lines:
            raise ValueError(f"--input-file {args.input_file}: holds no request")
        if not args.output_file.resolve().parent.is_dir():
            raise ValueError(f"--output-file {args.output_file}: its directory does not exist")
    except (ValueError, TypeError, NotImplementedError) as e:
        parser.error(str(e))
    model = config.served_model_name or served_name(args.model)
    names = (model, args.model)
    parsed: list[BatchRequest | LineFailure] = []
    for number, text in lines:
        try:
            parsed.append(parse_line(text, number, names, config.tool_call_parser is not None))
        except LineFailure as failure:
            parsed.append(failure)
    llm = LLM(**{f.name: getattr(args, f.name) for f in ENGINE_FIELDS})
    # LLM's own "Processed prompts" bar (one per call, so per group of lines) shows the progress.
    results = iter(BatchEngine(llm).run([p for p in parsed if isinstance(p, BatchRequest)]))
    ordered = [p if isinstance(p, LineFailure) else next(results) for p in parsed]
    tokenizer = llm.get_tokenizer()
    out = [_output_line(result, model, tokenizer) for result in ordered]
    with args.output_file.open("w", encoding="utf-8") as f:
        for line in out:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    failed = sum(line["error"] is not None or line["response"]["status_code"] != 200 for line in out)
    print(f"run-batch: wrote {len(out)} results to {args.output_file} ({failed} failed)", file=sys.stderr)
    return 0
