"""Tools and tool calls in OpenAI's shapes: checking `tools` / `tool_choice`, the calls of a finished
output (`{"id", "type", "function": {"name", "arguments"}}`) and of stream deltas (`{"index", ...}`: the
first with id, type and name, then the arguments), and joining deltas back into calls."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fastdeploy.tool_parsers.parsers import ParsedCall, new_call_id

__all__ = ["call_deltas", "call_dict", "check_tool_choice", "check_tools", "join_call_deltas", "new_call_id"]
TOOL_CHOICES = ("none", "auto", "required")


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """One tool or a list of tools in OpenAI's shape, `{"type": "function", "function": {"name": ...,
    "description": ..., "parameters": {JSON schema}}}`, as a list (None when there are none). The dicts are
    passed to the chat template as given, as transformers does."""
    if tools is None:
        return None
    listed = [tools] if isinstance(tools, Mapping) else tools
    if not isinstance(listed, (list, tuple)):
        raise TypeError(f"tools must be a list of tool dicts (or one tool dict), got {type(tools).__name__}")
    for i, tool in enumerate(listed):
        if not isinstance(tool, Mapping):
            raise TypeError(f"tools[{i}] must be a dict like {{'type': 'function', 'function': {{'name': ...}}}}, "
                            f"got {type(tool).__name__}")
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, Mapping):
            raise ValueError(f"tools[{i}] must have type 'function' and a 'function' object, got keys {sorted(tool)}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if "parameters" in function and not isinstance(function["parameters"], Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return [dict(t) for t in listed] or None


def check_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """'none', 'auto' or 'required', or `{"type": "function", "function": {"name": ...}}` naming one of the
    tools. Without tools only 'none' (or nothing) makes sense."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a named function, "
                             f"got {tool_choice!r}")
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice={tool_choice!r} needs tools")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not (isinstance(function, Mapping) and tool_choice.get("type") == "function"
            and isinstance(function.get("name"), str)):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                         f"'function': {{'name': ...}}}}, got {tool_choice!r}")
    names = [t["function"]["name"] for t in tools or []]
    if function["name"] not in names:
        raise ValueError(f"tool_choice names function {function['name']!r}, which is not among the tools {names}")
    return dict(tool_choice)


def call_dict(call: ParsedCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def call_deltas(call: ParsedCall, call_id: str, index: int) -> list[dict[str, Any]]:
    """A call as stream deltas: id, type and name first (empty arguments), then the arguments."""
    return [{"index": index, "id": call_id, "type": "function", "function": {"name": call.name, "arguments": ""}},
            {"index": index, "function": {"arguments": call.arguments}}]


def join_call_deltas(deltas: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Stream deltas (in order) -> the calls they make up, as a finished output lists them."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": None, "type": None,
                                                  "function": {"name": "", "arguments": ""}})
        for key in ("id", "type"):
            if delta.get(key) is not None:
                call[key] = delta[key]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]
