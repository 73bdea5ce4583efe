"""Tool-call parsers: split a model's answer (the content, after any reasoning split) into text and calls.

A parser looks at the whole content so far and returns the text outside the calls and the calls found.
Like the reasoning parsers, while the output is unfinished it returns only what can no longer change:
an unclosed `<tool_call>` block (or a tail that may still grow into one, or a JSON object or array still
open in the Llama 3 / Mistral formats) is held back, and a call is reported only once its block or JSON is
closed and parsed. So streamed deltas join to exactly the final split, and malformed call text is never
streamed as a call: it stays in the text.
"""
from __future__ import annotations

import json
import uuid
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


def call_of(obj: Any, keys: tuple[str, ...] = ("arguments",), required: bool = False) -> ParsedCall | None:
    """`{"name": ..., <key>: {...}}` -> a call (key one of `keys`, at most one given); None if obj is not such
    an object. Arguments given as a string holding a JSON object are taken as that object; missing arguments
    are {} unless `required`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    given = [k for k in keys if k in obj]
    if len(given) > 1 or (required and not given):
        return None
    arguments: Any = obj[given[0]] if given else {}
    if isinstance(arguments, str):
        arguments = loads(arguments)
    text = dumps(arguments) if isinstance(arguments, dict) else None
    return None if text is None else ParsedCall(obj["name"], text)


def parse_call(body: str) -> ParsedCall | None:
    """`{"name": ..., "arguments": {...}}` text -> a call (see call_of)."""
    return call_of(loads(body))


_DECODER = json.JSONDecoder()


def json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[pos] and the index after it; None if no whole value starts there."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(ABC):
    """Calls are `<tool_call>{json}</tool_call>` blocks; a valid block and the whitespace right after it
    leave the text, an invalid one stays in it as written."""

    name: ClassVar[str]
    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"
    # Whether a last block left open when the output ends still counts (a model stopped by a stop token).
    accept_unclosed: ClassVar[bool] = False
    # Special tokens the parser must see in the text even when the request skips special tokens (a
    # format's marker that is one special token, like Mistral's [TOOL_CALLS]): the detokenizer keeps them.
    MARKERS: ClassVar[tuple[str, ...]] = ()

    def new_call_id(self) -> str:
        """An id for a call found in the output (OpenAI's `call_...` unless the format wants others)."""
        return new_call_id()

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
            block = self.block(content, start + len(self.START), final)
            if block is None:
                break  # the block may still be completed: held back
            found, end = block
            if found:  # the block and the whitespace after it leave the text
                calls += found
                pos = skip_space(content, end)
            else:  # no call: it stays in the text as written
                text.append(content[start:end])
                pos = end
        return ToolCallSplit("".join(text), calls)

    def block(self, content: str, body: int, final: bool) -> tuple[list[ParsedCall], int] | None:
        """The calls of the block whose marker ends at `body` ([]: none, the block is text) and where it ends;
        None while it may still be completed. Here a `<tool_call>{json}</tool_call>` block."""
        end = content.find(self.END, body)
        if end == -1:  # an unclosed block: wait for it, or at the end decide what it was
            if not final:
                return None
            call = parse_call(content[body:]) if self.accept_unclosed else None
            return [call] if call is not None else [], len(content)
        call = parse_call(content[body:end])
        return [call] if call is not None else [], end + len(self.END)


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


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 JSON tool calls (vLLM's `llama3_json`): the calls end the answer, one or more
    `{"name": ..., "parameters": {...}}` objects ("arguments" also taken, not both) separated by `;`, opened
    by `<|python_tag|>` or starting the answer (whitespace aside). The text before the tag is text; an object
    that is no call, and whatever follows the objects, stay in the text as written. A call is reported as
    soon as its object is closed; an object still open is held back until it closes or the output ends."""

    name = "llama3_json"
    TAG: ClassVar[str] = "<|python_tag|>"
    MARKERS = (TAG,)

    def split(self, content: str, final: bool) -> ToolCallSplit:
        lead = skip_space(content, 0)
        if content.startswith("{", lead):
            start = pos = 0
        else:
            start = content.find(self.TAG)
            if start == -1:
                if not final and lead == len(content):
                    return ToolCallSplit("", [])  # only whitespace yet: the answer may still open with a call
                return ToolCallSplit(content if final else hold_back(content, self.TAG), [])
            pos = start + len(self.TAG)
        text, calls = [content[:start]], []
        pending = start  # text not placed yet: the tag, whitespace and `;` before the next object
        while True:
            at = skip_space(content, pos)
            parsed = json_at(content, at) if content.startswith("{", at) else None
            if parsed is None:
                if at < len(content) and not content.startswith("{", at):  # not an object: text from here on
                    text.append(content[pending:])
                elif final:  # nothing more, or an object left open or malformed
                    rest = content[pending:]
                    text.append("" if calls and rest.strip() in ("", ";") else rest)
                break  # else wait for more
            obj, end = parsed
            call = call_of(obj, ("parameters", "arguments"), required=True)
            if call is None:
                text.append(content[pending:end])
            else:
                calls.append(call)
            pending = pos = end
            after = skip_space(content, end)
            if after == len(content):
                if final and call is None:
                    text.append(content[pending:])
                break
            if content[after] != ";":
                text.append(content[pending:])
                break
            pos = after + 1
        return ToolCallSplit("".join(text), calls)


class MistralToolParser(ToolParser):
    """Mistral-7B-Instruct-v0.3 (vLLM's `mistral`): `[TOOL_CALLS]` followed by a JSON array of
    `{"name": ..., "arguments": {...}}` objects; text before it (and after it) is text, and a marker not
    followed by such an array stays in the text as written. The array's calls are reported once it is
    closed. Call ids are 9 letters and digits: Mistral's template refuses any other id sent back to it."""

    name = "mistral"
    START = "[TOOL_CALLS]"
    MARKERS = (START,)

    def new_call_id(self) -> str:
        return uuid.uuid4().hex[:9]

    def block(self, content: str, body: int, final: bool) -> tuple[list[ParsedCall], int] | None:
        at = skip_space(content, body)
        parsed = json_at(content, at) if content.startswith("[", at) else None
        if parsed is None:
            if not final and (at == len(content) or content.startswith("[", at)):
                return None  # the array may still come or close
            return [], at
        items, end = parsed
        found = [call_of(item, required=True) for item in items] if isinstance(items, list) else []
        return ([] if None in found else found), end  # not an array of calls: the marker and array stay text


PARSERS: dict[str, type[ToolParser]] = {
    **{cls.name: cls for cls in (ErnieX1ToolParser, HermesToolParser, Ernie45VLThinkingToolParser,
                                 Llama3JsonToolParser, MistralToolParser)},
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
