"""Incremental detokenization: turn a growing list of output ids into text deltas.

Same scheme as vLLM's prefix/read offsets: each call decodes only a short window of ids that starts
where the previous delta's context began (at first: the last few prompt ids, so spacing and word
joins come out as in a full decode), and emits the part of the window's text beyond that context.
A window whose text ends in U+FFFD is an unfinished multi-byte character (a byte-fallback or
byte-level token sequence cut short), so nothing is emitted until more ids complete it; `flush()`
releases whatever is still held when the sequence ends. Work per call is proportional to the new
ids plus the held-back ones, not to the output length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdeploy.input.tokenizer import Tokenizer

# Prompt ids kept as left context for the first delta (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one sequence; `"".join(deltas) + flush()` equals decoding all output ids."""

    __slots__ = ("_tokenizer", "_skip", "_ids", "_read", "_parts", "_text")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Window of ids still needed: context ids [0, _read) followed by ids whose text is not out yet.
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if len(prompt_token_ids) else []
        self._ids: list[int] = [int(i) for i in context]
        self._read = len(self._ids)
        self._parts: list[str] = []
        self._text: str | None = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text is None:
            self._text = "".join(self._parts)
        return self._text

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        if len(new_token_ids) == 0:
            return ""
        self._ids.extend(int(i) for i in new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Release text held back for an unfinished character (it decodes with U+FFFD); call at the end."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        ids = self._ids
        context = decode(ids[:self._read], skip_special_tokens=self._skip)
        window = decode(ids, skip_special_tokens=self._skip)
        if len(window) <= len(context) or (window.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new yet (a skipped special token) or a character still incomplete
        delta = window[len(context):]
        # The ids just emitted become the next window's context; older ids are no longer needed.
        del ids[:self._read]
        self._read = len(ids)
        self._parts.append(delta)
        self._text = None
        return delta
