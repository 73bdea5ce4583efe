"""Reasoning parsers: split a thinking model's output text into reasoning_content and text.

A parser looks at the whole visible output so far and returns (reasoning, content). While the
output is unfinished it returns only parts that can no longer change (a tail that may still
become a closing tag is held back), so streamed deltas join to exactly the final split.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

THINK_START, THINK_END = "<think>", "</think>"


def hold_back(text: str, marker: str, newline: bool = False) -> str:
    """text without a tail that is a proper prefix of marker (it may still grow into marker); with
    newline=True also without a newline just before that tail (it is dropped if marker follows)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            text = text[:-n]
            break
    return text[:-1] if newline and text.endswith("\n") else text


class ReasoningParser(ABC):
    name: ClassVar[str]

    def starts_in_reasoning(self, prompt_text: str | None, enable_thinking: bool) -> bool:
        """Whether generation begins inside the thinking part."""
        return enable_thinking

    @abstractmethod
    def split(self, text: str, final: bool, keep_tool_calls: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the output text so far; keep_tool_calls: tool-call blocks stay in the
        content (for a tool-call parser) instead of being dropped."""


class ErnieX1ReasoningParser(ReasoningParser):
    """ERNIE-X1 style: `thinking\\n</think>\\n\\n<response>\\nanswer\\n</response>` (or a tool call).

    Reasoning is the text before </think> (without one final newline). After it, a <response>
    block's inside is the answer; a <tool_call> block gives no text content (unless keep_tool_calls: then
    the calls are the content); anything else after </think> is the answer as it stands. With no
    </think>, everything is reasoning.
    """

    name = "ernie-x1"
    RESPONSE_START, RESPONSE_END, TOOL_CALL = "<response>", "</response>", "<tool_call>"

    def split(self, text: str, final: bool, keep_tool_calls: bool = False) -> tuple[str, str]:
        end = text.find(THINK_END)
        if end == -1:
            reasoning = text if final else hold_back(text, THINK_END, newline=True)
            return reasoning, ""
        reasoning = text[:end]
        reasoning = reasoning[:-1] if reasoning.endswith("\n") else reasoning
        rest = text[end + len(THINK_END):].lstrip("\n")
        if not final and any(tag.startswith(rest) for tag in (self.RESPONSE_START, self.TOOL_CALL)):
            return reasoning, ""  # not yet clear what follows
        if rest.startswith(self.TOOL_CALL):
            return reasoning, rest if keep_tool_calls else ""
        if not rest.startswith(self.RESPONSE_START):
            return reasoning, rest
        body = rest[len(self.RESPONSE_START):]
        if not final and body.strip("\n") == "":
            return reasoning, ""  # newlines right after <response> are dropped once content starts
        body = body.lstrip("\n")
        close = body.find(self.RESPONSE_END)
        if close != -1:
            body = body[:close]
            return reasoning, body[:-1] if body.endswith("\n") else body
        return reasoning, body if final else hold_back(body, self.RESPONSE_END, newline=True)


def prompt_opens_thinking(prompt_text: str | None, enable_thinking: bool) -> bool:
    """Whether the output starts in the thinking part: the prompt's last think tag is an open <think>
    (without the prompt text, enable_thinking decides)."""
    if prompt_text is None:
        return enable_thinking
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


class ErnieVLReasoningParser(ReasoningParser):
    """ERNIE-4.5-VL style: the prompt says whether the model thinks (the last of <think> or </think>
    in the prompt); when it does, text before </think> is reasoning and the rest is the answer."""

    name = "ernie-45-vl"

    def starts_in_reasoning(self, prompt_text: str | None, enable_thinking: bool) -> bool:
        return prompt_opens_thinking(prompt_text, enable_thinking)

    def split(self, text: str, final: bool, keep_tool_calls: bool = False) -> tuple[str, str]:
        end = text.find(THINK_END)
        if end == -1:
            return (text if final else hold_back(text, THINK_END)), ""
        return text[:end], text[end + len(THINK_END):]


class Qwen3ReasoningParser(ErnieVLReasoningParser):
    """Qwen3: the same split, thinking unless the template disabled it (enable_thinking=False);
    a leading <think> the model writes itself is dropped."""

    name = "qwen3"

    def starts_in_reasoning(self, prompt_text: str | None, enable_thinking: bool) -> bool:
        return enable_thinking

    def split(self, text: str, final: bool, keep_tool_calls: bool = False) -> tuple[str, str]:
        if text.startswith(THINK_START):
            text = text[len(THINK_START):]
        elif not final and THINK_START.startswith(text):
            return "", ""
        return super().split(text, final)


class Ernie45VLThinkingReasoningParser(ReasoningParser):
    """ERNIE-4.5-VL-Thinking: `thinking</think>answer`, or `thinking</think>\n<tool_call>...`.

    Text before </think> is reasoning (all of it while there is no </think>). After it, newlines are
    dropped (FastDeploy's stream drops them too); a tool call that follows gives no text content (the
    calls are the content with keep_tool_calls), anything else is the answer. Whether the model starts
    thinking: the last of <think> / </think> in the prompt, else enable_thinking.
    """

    name = "ernie-45-vl-thinking"
    TOOL_CALL = "<tool_call>"

    def starts_in_reasoning(self, prompt_text: str | None, enable_thinking: bool) -> bool:
        if not prompt_text or (THINK_START not in prompt_text and THINK_END not in prompt_text):
            return enable_thinking
        return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)

    def split(self, text: str, final: bool, keep_tool_calls: bool = False) -> tuple[str, str]:
        end = text.find(THINK_END)
        if end == -1:
            return (text if final else hold_back(text, THINK_END)), ""
        reasoning, body = text[:end], text[end + len(THINK_END):].lstrip("\n")
        if not final and self.TOOL_CALL.startswith(body):
            return reasoning, ""  # not yet clear whether a tool call follows
        if body.startswith(self.TOOL_CALL):
            return reasoning, body if keep_tool_calls else ""
        return reasoning, body


class DeepSeekReasoningParser(ReasoningParser):
    """DeepSeek-R1 / V3.1 style: the prompt opens the thinking part with <think> (the model may also write
    it), `thinking</think>answer` follows. Applies when the prompt's last think tag is an open <think>
    (else the output is all answer, as FastDeploy's content stage).

    With the model's own <think>: reasoning is what follows it up to </think>, as written. Without it:
    reasoning is the text before </think>, stripped of surrounding whitespace (also while </think> has
    not come). The answer after </think> is stripped; with no </think> there is no answer.
    """

    name = "deepseek"

    def starts_in_reasoning(self, prompt_text: str | None, enable_thinking: bool) -> bool:
        return prompt_opens_thinking(prompt_text, enable_thinking)

    def split(self, text: str, final: bool, keep_tool_calls: bool = False) -> tuple[str, str]:
        lead = text.lstrip()
        if not final and lead and THINK_START.startswith(lead) and lead != THINK_START:
            return "", ""  # may still become the model's own <think>
        explicit = lead.startswith(THINK_START)
        if explicit:
            text = lead[len(THINK_START):]
        end = text.find(THINK_END)
        if end == -1:
            reasoning = text if final else hold_back(text, THINK_END)
            return (reasoning if explicit else reasoning.strip()), ""
        reasoning = text[:end] if explicit else text[:end].strip()
        return reasoning, text[end + len(THINK_END):].strip()  # unfinished: a prefix of the final strip


# FastDeploy's registered names (DeepSeek's parser answers to four).
PARSERS: dict[str, type[ReasoningParser]] = {
    **{cls.name: cls for cls in (ErnieX1ReasoningParser, ErnieVLReasoningParser, Qwen3ReasoningParser,
                                 Ernie45VLThinkingReasoningParser)},
    **{name: DeepSeekReasoningParser for name in ("deepseek", "deepseek-r1", "deepseek-v3.1", "deepseek-v3-0324")},
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(PARSERS)}, got {name!r}")
    return PARSERS[name]()


def known_parsers() -> Sequence[str]:
    return sorted(PARSERS)
