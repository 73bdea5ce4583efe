"""Prompts and conversations as users pass them (LLM.generate / chat, the OpenAI server) -> prompt
text and token ids."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from fastdeploy.input.media import MediaError
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.model_executor.multimodal import MultimodalInputs

PromptType = Union[str, list[int], dict[str, Any]]
Prepared = tuple[str | None, list[int], MultimodalInputs | None]  # prompt text, token ids, media
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multimodal_data")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in value)


def normalize_prompts(prompts: Any) -> list[PromptType]:
    """The accepted shapes of `prompts`, as a list with one entry per request."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        for p in prompts:
            if not (isinstance(p, (str, dict)) or _is_token_ids(p)):
                raise TypeError("prompts must be a str, a list of str, a list of token ids, a list of lists of "
                                f"token ids, a dict or a list of dicts; got an element {p!r}")
        return list(prompts)
    raise TypeError(f"prompts must be a str, list or dict, got {type(prompts).__name__}")


def normalize_conversations(messages: Any) -> list[list[dict[str, Any]]]:
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and all(
            isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c) for c in messages):
        return [list(c) for c in messages]
    raise TypeError("messages must be one conversation (a list of {'role', 'content'} dicts) or a list of them")


def check_message(message: dict[str, Any], allow_media: bool = False) -> dict[str, Any]:
    """Text content parts are the template layer's business; media parts need a multimodal model. An
    assistant message with tool_calls may leave out content (OpenAI's shape)."""
    if "role" not in message or ("content" not in message and not message.get("tool_calls")):
        raise ValueError(f"each message needs 'role' and 'content', got keys {sorted(message)}")
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "video_url", "image", "video") and not allow_media:
                raise MediaError(f"content parts of type {kind!r} need a multimodal model (ERNIE-4.5-VL); this "
                                 "model is text-only")
    elif content is not None and not isinstance(content, str):
        raise TypeError(f"message content must be a str or a list of parts, got {type(content).__name__}")
    return message


def tokenize_prompt(tokenizer: Tokenizer, item: PromptType) -> tuple[str | None, list[int]]:
    """(prompt text, token ids) of one prompt in any accepted shape."""
    if isinstance(item, str):
        return item, tokenizer.encode(item)
    if isinstance(item, dict):
        unknown = sorted(set(item) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"prompt dict keys must be among {list(PROMPT_KEYS)}, got {unknown}")
        if item.get("multimodal_data"):
            raise MediaError("multimodal_data needs a multimodal model (ERNIE-4.5-VL); this model is text-only",
                             item.get("prompt"))
        text, ids = item.get("prompt"), item.get("prompt_token_ids")
        if ids is not None:
            if not _is_token_ids(ids):
                raise TypeError("prompt_token_ids must be a non-empty list of ints")
            return text, [int(t) for t in ids]
        if not isinstance(text, str):
            raise ValueError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of ints)")
        return text, tokenizer.encode(text)
    return None, [int(t) for t in item]


def render_chat_text(tokenizer: Tokenizer, conversation: Sequence[Mapping[str, Any]],
                     chat_template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
                     allow_media: bool = False, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """One conversation rendered with the chat template (media parts as their placeholders); `tools`
    (OpenAI tool dicts) reach the template as its `tools` variable."""
    messages = [check_message(m, allow_media) for m in conversation]
    kwargs = {"chat_template": chat_template, **(chat_template_kwargs or {})}
    # The prompt opens the assistant's reply unless it continues the last message (transformers' two modes).
    kwargs.setdefault("add_generation_prompt", not kwargs.get("continue_final_message", False))
    if tools is not None:
        if "tools" in kwargs:
            raise ValueError("pass tools either as tools= or in chat_template_kwargs, not both")
        kwargs["tools"] = list(tools)
    return tokenizer.apply_chat_template(messages, **kwargs)


def render_chat(tokenizer: Tokenizer, conversation: Sequence[Mapping[str, Any]],
                chat_template_kwargs: Mapping[str, Any] | None = None,
                chat_template: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None
                ) -> tuple[str, list[int]]:
    """(prompt text, token ids) of one conversation rendered with the chat template."""
    text = render_chat_text(tokenizer, conversation, chat_template_kwargs, chat_template, tools=tools)
    return text, tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself


@dataclass(slots=True)
class TextPrompts:
    """A text-only model's prompts: the same calls as MultimodalPrompts, media refused with MediaError."""

    tokenizer: Tokenizer

    def from_prompt(self, item: PromptType) -> Prepared:
        return *tokenize_prompt(self.tokenizer, item), None

    def from_chat(self, conversation: Sequence[Mapping[str, Any]], chat_template_kwargs: Mapping[str, Any] | None,
                  chat_template: str | None, tools: Sequence[Mapping[str, Any]] | None = None) -> Prepared:
        return *render_chat(self.tokenizer, conversation, chat_template_kwargs, chat_template, tools), None
