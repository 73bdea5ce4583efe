"""Tool-call parsers: split a model's answer (the content, after any reasoning split) into text and calls.

A parser looks at the whole content so far and returns the text outside the calls and the calls found.
Like the reasoning parsers, while the output is unfinished it returns only what can no longer change:
an unclosed `<tool_call>` block (or a tail that may still grow into one) is held back, and a call is
reported only once its block is closed and its JSON parsed. So streamed deltas join to exactly the final
split, and malformed call text is never streamed as a call: it stays in the text.
"""
from __future__ import annotations

import json
from abc import ABC
from dataclasses import dataclass
from typing import Any, ClassVar

from fastdeploy.reasoning.parsers import hold_back


@dataclass(slots=True, frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(slots=True)
class ToolCallSplit:
    text: str  # the content outside the calls
    calls: list[ParsedCall]


_INVALID = object()  # what loads() returns for text that is not (usable) JSON


def loads(text: str) -> Any:
    """json.loads, or _INVALID: deeply nested JSON (model output a client can steer) raises RecursionError,
    which must leave the text unparsed like any other bad JSON rather than fail the request."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID


def dumps(value: Any) -> str | None:
    """json.dumps, or None when the value nests too deeply to encode."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None


def parse_call(body: str) -> ParsedCall | None:
    """`{"name": ..., "arguments": {...}}` -> a call; None if the body is not such an object. Arguments given
    as a string holding a JSON object are taken as that object; missing arguments are {}."""
    obj = loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: Any = obj.get("arguments", {})
    if isinstance(arguments, str):
        arguments = loads(arguments)
    text = dumps(arguments) if isinstance(arguments, dict) else None
    return None if text is None else ParsedCall(obj["name"], text)


class ToolParser(ABC):
    """Calls are `<tool_call>{json}</tool_call>` blocks; a valid block and the whitespace right after it
    leave the text, an invalid one stays in it as written."""

    name: ClassVar[str]
    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"
    # Whether a last block left open when the output ends still counts (a model stopped by a stop token).
    accept_unclosed: ClassVar[bool] = False

    def split(self, content: str, final: bool) -> ToolCallSplit:
        text: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = content.find(self.START, pos)
            if start == -1:
                tail = content[pos:]
                text.append(tail if final else hold_back(tail, self.START))
                break
            text.append(content[pos:start])
            body_start = start + len(self.START)
            end = content.find(self.END, body_start)
            if end == -1:  # an unclosed block: wait for it, or at the end decide what it was
                call = parse_call(content[body_start:]) if final and self.accept_unclosed else None
                if call is not None:
                    calls.append(call)
                elif final:
                    text.append(content[start:])
                break
            pos = end + len(self.END)
            call = parse_call(content[body_start:end])
            if call is None:
                text.append(content[start:pos])
                continue
            calls.append(call)
            while pos < len(content) and content[pos].isspace():
                pos += 1
        return ToolCallSplit("".join(text), calls)


class ErnieX1ToolParser(ToolParser):
    """ERNIE-X1 / ERNIE-4.5 thinking models: after `</think>`, one or more
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks; a block must be closed."""

    name = "ernie-x1"


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks; the
    last block may be left open when the output ends (e.g. `</tool_call>` used as a stop string)."""

    name = "hermes"
    accept_unclosed = True


class Ernie45VLThinkingToolParser(ToolParser):
    """ERNIE-4.5-VL-Thinking (FastDeploy's `ernie-45-vl-thinking`, registered there as `ernie_45-vl-thinking`):
    after the thinking part, either an answer or `<tool_call>` blocks, nothing else. The content has calls only
    when it opens with a block (newlines aside); then every block must hold a whole call, and the last may be
    left open when the output ends. Anything else is an answer: all of it text, blocks and all."""

    name = "ernie-45-vl-thinking"
    accept_unclosed = True

    def split(self, content: str, final: bool) -> ToolCallSplit:
        lead = content.lstrip("\n")
        if not (lead.startswith(self.START) or self.START.startswith(lead)):
            return ToolCallSplit(content, [])  # an answer
        if not final:
            # Text after a call would still make all of it an answer: nothing is sure before the end.
            return ToolCallSplit("", [])
        split = super().split(lead, final)
        if split.text.strip() or not split.calls:  # text beside the calls, or a block that is no call
            return ToolCallSplit(content, [])
        return ToolCallSplit("", split.calls)


PARSERS: dict[str, type[ToolParser]] = {
    **{cls.name: cls for cls in (ErnieX1ToolParser, HermesToolParser, Ernie45VLThinkingToolParser)},
    "ernie_45-vl-thinking": Ernie45VLThinkingToolParser,  # FastDeploy's registered spelling
}


def known_tool_parsers() -> list[str]:
    return sorted(PARSERS)


def register_tool_parser(cls: type[ToolParser]) -> type[ToolParser]:
    """Make a ToolParser subclass (with a `name`) available as tool_call_parser=<name>; a class decorator for
    tool_parser_plugin files (tool_parsers/plugins.py)."""
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)) or not isinstance(getattr(cls, "name", None), str):
        raise TypeError(f"a tool parser must be a fastdeploy.tool_parsers.ToolParser subclass with a `name`, got {cls!r}")
    PARSERS[cls.name] = cls
    return cls


def get_tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {known_tool_parsers()}, got {name!r}")
    return PARSERS[name]()
