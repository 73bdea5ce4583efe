"""tool_parser_plugin: a Python file of the operator's that defines tool-call parsers, loaded at start-up.

The file defines `fastdeploy.tool_parsers.ToolParser` subclasses, each with a `name`, and registers them with
`@fastdeploy.tool_parsers.register_tool_parser`; `tool_call_parser=<name>` then picks one. It runs as code
of the process (the operator's, like the model directory: a request can never name a file). FastDeploy's
own plugin interface (`ToolParserManager`, `extract_tool_calls`) is not provided here: such a file fails to
import with an error saying so.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from fastdeploy.tool_parsers.parsers import PARSERS

_loaded: dict[str, list[str]] = {}  # resolved path -> the parser names it registered (each file runs once)


def load_tool_parser_plugin(path: str) -> list[str]:
    """Run the plugin file once; the names of the parsers it registered. ValueError naming tool_parser_plugin
    when the file is missing, fails to import, or registers nothing."""
    real = os.path.realpath(path)
    if real in _loaded:
        return _loaded[real]
    if not Path(real).is_file() or not real.endswith(".py"):
        raise ValueError(f"tool_parser_plugin must be a .py file, got {path!r}")
    before = set(PARSERS)
    spec = importlib.util.spec_from_file_location(f"fastdeploy_tool_parser_plugin_{len(_loaded)}", real)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise ValueError(f"tool_parser_plugin {path!r} could not be imported ({e}); it must define "
                         "fastdeploy.tool_parsers.ToolParser subclasses registered with register_tool_parser "
                         "(FastDeploy's ToolParserManager interface is not provided)") from e
    names = sorted(set(PARSERS) - before)
    if not names:
        raise ValueError(f"tool_parser_plugin {path!r} registered no parser: decorate its ToolParser subclasses "
                         "with @fastdeploy.tool_parsers.register_tool_parser")
    _loaded[real] = names
    return names
