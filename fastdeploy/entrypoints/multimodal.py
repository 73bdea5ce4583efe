"""Multimodal prompts (ERNIE-4.5-VL) for LLM.generate / chat and the server: media of the chat's content
parts or of `multimodal_data` -> (prompt text, expanded token ids, MultimodalInputs)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastdeploy.config import EngineConfig
from fastdeploy.entrypoints.prompts import PROMPT_KEYS, Prepared, TextPrompts, render_chat_text, tokenize_prompt
from fastdeploy.model_executor.models.ernie4_5_vl.processor import (
    MediaProcessor, media_of_messages, multimodal_data_media, prepare)
from fastdeploy.input.media import TRUSTED, MediaError, MediaPolicy
from fastdeploy.input.tokenizer import Tokenizer


@dataclass(slots=True)
class MultimodalPrompts:
    tokenizer: Tokenizer
    tokens: Any  # VLTokenIds
    media: MediaProcessor

    @classmethod
    def create(cls, config: EngineConfig, tokenizer: Tokenizer,
               policy: MediaPolicy = TRUSTED) -> MultimodalPrompts | None:
        """None for a text-only model. `policy`: what reading media may do (the server's from its flags)."""
        vl = config.model_config.multimodal
        if vl is None:
            return None
        media = MediaProcessor.from_pretrained(config.model, config.limit_mm_per_prompt, config.mm_processor_kwargs,
                                               policy)
        return cls(tokenizer, vl.tokens, media)

    def _prepare(self, text: str, images: list[Any], videos: list[Any]) -> Prepared:
        try:
            ids, mm = prepare(self.tokenizer, self.tokens, self.media, text, images, videos)
        except ValueError as e:
            raise MediaError(str(e), text) from e
        return text, ids, mm

    def from_prompt(self, item: Any) -> Prepared:
        if not (isinstance(item, Mapping) and item.get("multimodal_data")):
            return *tokenize_prompt(self.tokenizer, item), None  # placeholder ids without media: the engine refuses
        unknown = sorted(set(item) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"prompt dict keys must be among {list(PROMPT_KEYS)}, got {unknown}")
        text = item.get("prompt")
        if not isinstance(text, str):
            raise ValueError("a prompt with multimodal_data needs 'prompt' text holding the image/video "
                             "placeholders (prompt_token_ids are not supported with media)")
        return self._prepare(text, *multimodal_data_media(item["multimodal_data"]))

    def from_chat(self, conversation: Sequence[Mapping[str, Any]], chat_template_kwargs: Mapping[str, Any] | None,
                  chat_template: str | None, tools: Sequence[Mapping[str, Any]] | None = None) -> Prepared:
        text = render_chat_text(self.tokenizer, conversation, chat_template_kwargs, chat_template, allow_media=True,
                                tools=tools)
        return self._prepare(text, *media_of_messages(conversation))


def prompts_for(config: EngineConfig, tokenizer: Tokenizer,
                policy: MediaPolicy = TRUSTED) -> TextPrompts | MultimodalPrompts:
    """How the model's prompts become token ids (and media inputs); offline LLM reads media as trusted."""
    return MultimodalPrompts.create(config, tokenizer, policy) or TextPrompts(tokenizer)
