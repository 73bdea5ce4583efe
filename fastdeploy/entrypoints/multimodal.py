"""Multimodal prompts (ERNIE-4.5-VL) for LLM.generate / chat: media of the chat's content parts or of
`multimodal_data` -> (prompt text, expanded token ids, MultimodalInputs)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastdeploy.config import EngineConfig
from fastdeploy.entrypoints.prompts import PROMPT_KEYS, render_chat_text, tokenize_prompt
from fastdeploy.input.ernie4_5_vl_processor import (
    MediaProcessor,
    MultimodalInputs,
    media_of_messages,
    multimodal_data_media,
    prepare,
)
from fastdeploy.input.tokenizer import Tokenizer

Prepared = tuple[str | None, list[int], MultimodalInputs | None]


@dataclass(slots=True)
class MultimodalPrompts:
    tokenizer: Tokenizer
    tokens: Any  # VLTokenIds
    media: MediaProcessor
    tensor_parallel_size: int

    @classmethod
    def create(cls, config: EngineConfig, tokenizer: Tokenizer) -> MultimodalPrompts | None:
        """None for a text-only model."""
        vl = config.model_config.multimodal
        if vl is None:
            return None
        media = MediaProcessor.from_pretrained(config.model, config.limit_mm_per_prompt, config.mm_processor_kwargs)
        return cls(tokenizer, vl.tokens, media, config.tensor_parallel_size)

    def _prepare(self, text: str, images: list[Any], videos: list[Any]) -> Prepared:
        if (images or videos) and self.tensor_parallel_size > 1:
            raise NotImplementedError("images and videos with tensor_parallel_size > 1 are not supported yet "
                                      "(text prompts on ERNIE-4.5-VL are)")
        ids, mm = prepare(self.tokenizer, self.tokens, self.media, text, images, videos)
        return text, ids, mm

    def from_prompt(self, item: Any) -> Prepared:
        if not (isinstance(item, Mapping) and item.get("multimodal_data")):
            text, ids = tokenize_prompt(self.tokenizer, item)
            if self.tokens.image in ids or self.tokens.video in ids:
                raise ValueError("the prompt holds image/video placeholder tokens but no multimodal_data; pass the "
                                 "media with the prompt text")
            return text, ids, None
        unknown = sorted(set(item) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"prompt dict keys must be among {list(PROMPT_KEYS)}, got {unknown}")
        text = item.get("prompt")
        if not isinstance(text, str):
            raise ValueError("a prompt with multimodal_data needs 'prompt' text holding the image/video "
                             "placeholders (prompt_token_ids are not supported with media)")
        return self._prepare(text, *multimodal_data_media(item["multimodal_data"]))

    def from_chat(self, conversation: Sequence[Mapping[str, Any]], chat_template_kwargs: Mapping[str, Any] | None,
                  chat_template: str | None) -> Prepared:
        text = render_chat_text(self.tokenizer, conversation, chat_template_kwargs, chat_template, allow_media=True)
        return self._prepare(text, *media_of_messages(conversation))
