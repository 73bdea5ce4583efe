"""Calls forced by tool_choice ("required" or a named function), as vLLM makes them: the output is
constrained by a JSON schema (guided decoding) and the whole output is the call(s).

- a named function: the output is that function's arguments object;
- "required": the output is a non-empty array of `{"name": <one of the tools>, "parameters": {...}}`.

The parsers report the calls only when the output has finished (until then nothing is sure: an output cut
by max_tokens is not valid JSON, and then it stays text, as a malformed call does).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastdeploy.tool_parsers.parsers import ParsedCall, ToolCallSplit, ToolParser, dumps, loads


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    return dict(tool["function"].get("parameters") or {"type": "object", "properties": {}})


def forced_call_schema(tool_choice: str | Mapping[str, Any], tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON schema the output must follow for tool_choice "required" or a named function."""
    if tool_choice != "required":
        name = tool_choice["function"]["name"]
        return _parameters(next(t for t in tools if t["function"]["name"] == name))
    one_of_tools = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                      "parameters": _parameters(t)},
                     "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": one_of_tools}}


def _arguments(value: Any) -> str | None:
    return dumps(value) if isinstance(value, dict) else None


class NamedCallParser(ToolParser):
    """The whole output is the arguments of `function`."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def split(self, content: str, final: bool) -> ToolCallSplit:
        if not final:
            return ToolCallSplit("", [])
        arguments = _arguments(loads(content))
        if arguments is None:
            return ToolCallSplit(content, [])
        return ToolCallSplit("", [ParsedCall(self.function, arguments)])


class RequiredCallsParser(ToolParser):
    """The whole output is an array of {"name", "parameters"} objects."""

    name = "required"

    def split(self, content: str, final: bool) -> ToolCallSplit:
        if not final:
            return ToolCallSplit("", [])
        items = loads(content)
        calls = []
        for item in items if isinstance(items, list) and items else [None]:
            arguments = _arguments(item.get("parameters")) if isinstance(item, dict) else None
            if arguments is None or not isinstance(item.get("name"), str):
                return ToolCallSplit(content, [])
            calls.append(ParsedCall(item["name"], arguments))
        return ToolCallSplit("", calls)


def forced_call_parser(tool_choice: str | Mapping[str, Any]) -> ToolParser:
    if tool_choice == "required":
        return RequiredCallsParser()
    return NamedCallParser(tool_choice["function"]["name"])
