"""The engine is closed (issue 42): its Request records and the parts that own them (scheduler, block manager,
output processor, step building) are reached only from inside fastdeploy/engine/; callers go through its doors
(make_submission, submit, abort, cancel, fail_all, waiting, stats, step). Read from the sources."""
from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

import fastdeploy

PACKAGE = Path(fastdeploy.__file__).parent
ENGINE = PACKAGE / "engine"
# engine/ modules that hold or build the scheduler's records: nothing outside engine/ imports them.
PRIVATE = {"request", "scheduler", "block_manager", "output_processor", "step_builder", "structured_output"}
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


def test_a_requests_offline_path_crosses_at_most_16_files() -> None:
    """Issue 42's bound on how much code a request's way through the engine asks a reader to follow: the
    fastdeploy files whose functions run while LLM.generate serves one sampled prompt on the compiled step
    (the demo model; FastDeploy's default min_tokens=1 bans EOS on the first token)."""
    from fastdeploy import LLM, SamplingParams

    llm = LLM(model=str(PACKAGE.parent / "models" / "ernie-4.5-demo"), max_model_len=256)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)
    llm.generate(["warm up"], params, use_tqdm=False)
    crossed: set[str] = set()

    def profile(frame, event, arg) -> None:  # noqa: ANN001 - sys.setprofile's signature
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            crossed.add(str(Path(frame.f_code.co_filename).relative_to(PACKAGE)))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        outputs = llm.generate(["Tell me about the sea"], params, use_tqdm=False)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert outputs[0].outputs.token_ids, "nothing was generated"
    assert "worker/compiled_step.py" in crossed, sorted(crossed)
    assert len(crossed) <= 16, sorted(crossed)
