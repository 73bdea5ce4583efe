"""llguidance's token table (LLTokenizer) built from our Tokenizer, once per LLM.

A `tokenizer.json` tokenizer is handed to llguidance as its JSON text. For a sentencepiece tokenizer the
bytes of every id are spelled out: pieces with '▁' as a space, byte pieces (<0xAB>) as that byte, added
non-special tokens as their text, and special tokens marked special (the grammar never produces them;
EOS is allowed where the grammar may end). Ids past the tokenizer's vocabulary (models pad the LM head)
get no bytes, so no grammar ever allows them.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import llguidance

from fastdeploy.input.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# llguidance's spelling of a special token: 0xFF, then its name.
SPECIAL_MARKER = b"\xff"


class _SentencePieceTable:
    """The TokenizerWrapper protocol llguidance reads: per-id bytes, special ids, eos/bos, and encode."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_id: int) -> None:
        special = set(tokenizer.all_special_ids)
        pieces = tokenizer.convert_ids_to_tokens(range(min(tokenizer.vocab_size, vocab_size)))
        tokens: list[bytes] = []
        for i, piece in enumerate(pieces):
            if i in special:
                tokens.append(SPECIAL_MARKER + piece.encode("utf-8"))
            elif (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
                tokens.append(bytes([int(byte.group(1), 16)]))
            else:
                tokens.append(piece.replace("\u2581", " ").encode("utf-8"))
        tokens += [b""] * (vocab_size - len(tokens))
        self.tokens = tokens
        self.special_token_ids = sorted(i for i in special if i < vocab_size)
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def build_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """The LLTokenizer for a model whose logits have `vocab_size` columns (about a second for 100k tokens:
    build it once)."""
    eos = sorted(eos_token_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    if not eos:
        raise ValueError("guided decoding needs an end-of-sequence token; the model and tokenizer define none")
    vocab_size = max(vocab_size, tokenizer.vocab_size)
    text = tokenizer.backend_json()
    if text is not None:
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
    table = _SentencePieceTable(tokenizer, vocab_size, eos[0])
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), n_vocab=vocab_size, eos_token=eos)
