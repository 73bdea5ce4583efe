"""The engine is closed (issue 42): its Request records and the parts that own them (scheduler, block manager,
output processor, step building) are reached only from inside fastdeploy/engine/; callers go through its doors
(make_submission, submit, abort, cancel, fail_all, waiting, stats, step). Read from the sources."""
from __future__ import annotations

import ast
from pathlib import Path

import fastdeploy

PACKAGE = Path(fastdeploy.__file__).parent
ENGINE = PACKAGE / "engine"
# engine/ modules that hold or build the scheduler's records: nothing outside engine/ imports them.
PRIVATE = {"request", "scheduler", "block_manager", "output_processor", "step_builder", "guided_requests"}
PRIVATE_ATTRIBUTES = {"scheduler", "block_manager", "output_processor", "_routes"}


def sources_outside_engine() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if ENGINE not in p.parents]


def imported_engine_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n.split(".")[2] for n in names if n.startswith("fastdeploy.engine.") and n.count(".") >= 2}
    return found


def test_no_module_outside_the_engine_imports_its_records() -> None:
    offenders = {str(p.relative_to(PACKAGE)): sorted(imported_engine_modules(ast.parse(p.read_text())) & PRIVATE)
                 for p in sources_outside_engine()}
    assert {p: m for p, m in offenders.items() if m} == {}


def test_entrypoints_use_only_the_engines_doors() -> None:
    touched = {}
    for path in (PACKAGE / "entrypoints").rglob("*.py"):
        names = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
        if names & PRIVATE_ATTRIBUTES:
            touched[str(path.relative_to(PACKAGE))] = sorted(names & PRIVATE_ATTRIBUTES)
    assert touched == {}


def test_the_checks_see_a_violation() -> None:
    """The two checks above would catch what they look for."""
    tree = ast.parse("from fastdeploy.engine.request import Request\nimport fastdeploy.engine.scheduler\n")
    assert imported_engine_modules(tree) == {"request", "scheduler"}
    tree = ast.parse("engine.output_processor.release(x)")
    assert {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & PRIVATE_ATTRIBUTES
