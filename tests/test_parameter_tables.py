"""The parameter tables of the docs match the code (issue 16): docs/offline_inference.md's `LLM(model,
**engine_args)` table against EngineArgs and its `SamplingParams` table against the SamplingParams dataclass
(every row's name and default, a row for every field, no row for something the code lacks), and
docs/online_serving.md's flag tables against the server's parser.

A default cell is `required`, or a Python literal optionally followed by an explanation in parentheses:
`None (model default, else 0.0)` means None."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from fastdeploy import SamplingParams
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.openai.cli_args import NOT_IMPLEMENTED_FLAGS, make_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
REQUIRED = "required"


def table_rows(page: str, heading: str) -> list[tuple[str, str]]:
    """(first cell without backticks, second cell) of each body row of the first table under `heading`."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    assert heading in lines, f"{page} has no heading {heading!r}"
    rows: list[tuple[str, str]] = []
    for line in lines[lines.index(heading) + 1:]:
        if not line.startswith("|"):
            if rows:
                break  # the table has ended
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith("`"):  # skips the header and |---| lines
            rows.append((cells[0].split("`")[1], cells[1]))
    assert rows, f"no table under {heading!r} in {page}"
    return rows


def documented_default(cell: str) -> Any:
    if cell == REQUIRED:
        return dataclasses.MISSING
    literal = cell.split(" (", 1)[0]
    try:
        return ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        pytest.fail(f"default cell {cell!r} does not start with a Python literal")


def field_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if not f.name.startswith("_")}


@pytest.mark.parametrize("heading, cls", [
    ("## `LLM(model, **engine_args)`", EngineArgs),
    ("## `SamplingParams`", SamplingParams),
], ids=["LLM", "SamplingParams"])
def test_offline_inference_table_matches_the_dataclass(heading, cls):
    rows = table_rows("offline_inference.md", heading)
    names = [name for name, _ in rows]
    assert sorted({n for n in names if names.count(n) > 1}) == [], "a parameter has two rows"
    code = field_defaults(cls)
    assert sorted(set(code) - set(names)) == [], "fields without a row"
    assert sorted(set(names) - set(code)) == [], "rows naming no field"
    wrong = {name: (cell, code[name]) for name, cell in rows if documented_default(cell) != code[name]
             or type(documented_default(cell)) is not type(code[name])}
    assert wrong == {}, "documented default (cell) != the code's"


def test_online_serving_flag_tables_match_the_parser():
    parser = make_parser()
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}
    rows = (table_rows("online_serving.md", "### Server")
            + table_rows("online_serving.md", "### Engine (the `LLM(...)` parameters)"))
    documented = dict(rows)
    # FastDeploy's flags this engine refuses are listed together below the tables (test_api_server checks that).
    engine_and_server = {flag for flag, a in actions.items() if a.dest not in NOT_IMPLEMENTED_FLAGS}
    assert sorted(engine_and_server - set(documented)) == []
    assert sorted(set(documented) - set(actions)) == []
    wrong = {flag: (cell, actions[flag].default) for flag, cell in documented.items()
             if cell != (REQUIRED if actions[flag].required else str(actions[flag].default))}
    assert wrong == {}
