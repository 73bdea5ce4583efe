"""FastDeploy's import path for the ERNIE tokenizers (`from fastdeploy.input.ernie_tokenizer import
ErnieBotTokenizer`, or `Ernie4_5Tokenizer` as FastDeploy's Chinese offline-inference page imports it): a thin
class over the project's Tokenizer whose apply_chat_template takes transformers' `tokenize` keyword, so the
documented ERNIE-4.5-VL `generate` example renders its prompt unchanged."""
from __future__ import annotations

from typing import Any

from fastdeploy.input.tokenizer import Tokenizer


class ErnieBotTokenizer(Tokenizer):
    def apply_chat_template(self, messages: list[dict], *, tokenize: bool = False, add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """The conversation rendered with the model's template (image / video parts as their placeholders);
        tokenize=True: its token ids instead (the template writes BOS itself)."""
        text = super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


Ernie4_5Tokenizer = ErnieBotTokenizer  # the same class under its ERNIE-4.5 name

__all__ = ["Ernie4_5Tokenizer", "ErnieBotTokenizer"]
