"""The package's import structure, read from the sources: no cycles among fastdeploy modules, and the
lower layers never reach up (ops < sampling and model_executor < worker < engine < entrypoints)."""
import ast
from pathlib import Path

import fastdeploy

PACKAGE = Path(fastdeploy.__file__).parent
# Layer -> the fastdeploy packages it must not import (anything above it).
FORBIDDEN = {
    "fastdeploy.ops": ("fastdeploy.sampling", "fastdeploy.model_executor", "fastdeploy.worker", "fastdeploy.engine",
                       "fastdeploy.entrypoints"),
    # The sampling stage: over ops (the compiled sampler) and the step's types, under the runner that calls it.
    "fastdeploy.sampling": ("fastdeploy.model_executor", "fastdeploy.worker", "fastdeploy.engine",
                            "fastdeploy.entrypoints"),
    "fastdeploy.model_executor": ("fastdeploy.worker", "fastdeploy.engine", "fastdeploy.entrypoints"),
    "fastdeploy.worker": ("fastdeploy.engine", "fastdeploy.entrypoints"),
    "fastdeploy.engine": ("fastdeploy.entrypoints",),
}


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("fastdeploy",) + path.relative_to(PACKAGE).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """fastdeploy modules `name` imports anywhere in its source (function bodies too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this one
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` depends on the module, else on pkg
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). The top-level package is left
    out: every `from fastdeploy import x` passes through its __init__, which re-exports the API."""
    edges = {a: bs - {"fastdeploy"} for a, bs in graph.items() if a != "fastdeploy"}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_sources():
    graph = import_graph()
    assert "fastdeploy.step_types" in graph["fastdeploy.worker.model_runner"]
    assert "fastdeploy.engine.scheduler" in graph["fastdeploy.engine.engine"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_lower_layers_never_import_upper_ones():
    reaches = [(a, b) for a, bs in import_graph().items() for layer, above in FORBIDDEN.items()
               if a == layer or a.startswith(layer + ".") for b in bs if b.startswith(above)]
    assert reaches == []


def test_the_step_types_import_no_fastdeploy_module():
    """Every layer imports the step's boundary types, so they import none: numpy only."""
    assert import_graph()["fastdeploy.step_types"] == set()
