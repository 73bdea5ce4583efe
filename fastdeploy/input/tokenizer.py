"""Tokenizers read straight from a checkpoint directory, matching transformers' results.

Two backends:
- `tokenizer.json` (HF `tokenizers`, e.g. Qwen, converted ERNIE -PT repos): the file itself decides
  normalisation, added tokens, BOS/EOS insertion (its post-processor) and decoding, as in
  transformers' `TokenizersBackend`.
- `tokenizer.model` (sentencepiece, e.g. ERNIE -Paddle repos), with ERNIE's tokenizer semantics:
  added/special tokens in the text are split off first (leftmost, longest match) and become single
  ids, each remaining piece of text is encoded by sentencepiece, no BOS/EOS is added unless the
  config says `add_bos_token`/`add_eos_token`, and decoding writes special tokens verbatim and the
  runs between them through sentencepiece (no clean-up, no spaces around special tokens).
`tokenizer.json` wins when a directory has both. Special tokens come from tokenizer_config.json and
the legacy special_tokens_map.json/added_tokens.json; the named ones are bos, eos, unk, sep, pad,
cls, mask (other `*_token` keys such as ERNIE's `sys_start_token` are not special).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdeploy.input.chat_template import (
    RequestTemplate,
    load_chat_template,
    render_chat_template,
    resolve_chat_template,
    select_chat_template,
)

logger = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(slots=True, frozen=True)
class AddedToken:
    content: str
    special: bool = False
    lstrip: bool = False
    rstrip: bool = False


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(value: Any) -> str | None:
    """A token given as a string or as a serialised AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _token_list(value: Any) -> list[str]:
    if isinstance(value, Mapping):  # v5 may store model-specific extras as a name -> token dict
        value = list(value.values())
    return [tok for tok in (_content(v) for v in value or ()) if tok]


def _special_tokens(directory: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Named special tokens (standard names first) and the extra special tokens, as transformers reads them."""
    named = {k: v for k in SPECIAL_TOKEN_NAMES if (v := _content(config.get(k)))}
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    model_specific: dict[str, str] = {}
    if isinstance(extra, Mapping):  # transformers 5's named extras ("image_token": ...) act as named tokens
        model_specific = {k: v for k, value in extra.items() if (v := _content(value))}
        extra = None
    extras = _token_list(extra)
    if "added_tokens_decoder" not in config:  # legacy layout: special_tokens_map.json may add or override
        for key, value in _read_json(directory / "special_tokens_map.json").items():
            if key in SPECIAL_TOKEN_NAMES and _content(value):
                named[key] = _content(value)
            elif key in ("additional_special_tokens", "extra_special_tokens"):
                extras += [t for t in _token_list(value) if t not in extras]
    ordered = {k: named[k] for k in SPECIAL_TOKEN_NAMES if k in named}
    return {**ordered, **model_specific}, extras


class _SentencePieceBackend:
    """tokenizer.model plus added tokens, with ERNIE's splitting and decoding rules."""

    def __init__(self, model_file: Path, unk_token: str | None, split_special_tokens: bool) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.sp_size = self.sp.get_piece_size()
        self.unk_token = unk_token
        self.split_special_tokens = split_special_tokens
        self.set_added({}, set())

    def set_added(self, added: dict[int, AddedToken], special_ids: set[int]) -> None:
        self.added = added
        self.added_encoder = {tok.content: i for i, tok in added.items()}
        self.special_ids = special_ids
        # Longest alternatives first: re picks the leftmost match and, there, the first alternative.
        tokens = sorted(self.added_encoder, key=len, reverse=True)
        self.splitter = None if self.split_special_tokens or not tokens else re.compile(
            "(" + "|".join(re.escape(t) for t in tokens) + ")")

    def vocab_size(self) -> int:
        return self.sp_size + sum(1 for i in self.added if i >= self.sp_size)

    def token_to_id(self, token: str) -> int | None:
        if token in self.added_encoder:
            return self.added_encoder[token]
        piece_id = self.sp.piece_to_id(token)
        return piece_id if self.sp.id_to_piece(piece_id) == token else None

    def get_vocab(self) -> dict[str, int]:
        vocab = {self.sp.id_to_piece(i): i for i in range(self.sp_size)}
        vocab.update(self.added_encoder)
        return vocab

    def encode(self, text: str) -> list[int]:
        if self.splitter is None:
            return self.sp.encode(text) if text else []
        parts = self.splitter.split(text)  # odd positions hold the added tokens
        for i in range(1, len(parts), 2):
            tok = self.added[self.added_encoder[parts[i]]]
            if tok.rstrip:
                parts[i + 1] = parts[i + 1].lstrip()
            if tok.lstrip:
                parts[i - 1] = parts[i - 1].rstrip()
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self.added_encoder[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def id_to_token(self, index: int) -> str | None:
        if index in self.added:
            return self.added[index].content
        if 0 <= index < self.sp_size:
            return self.sp.id_to_piece(index)
        return self.unk_token  # ids beyond the vocabulary read as unk, as ERNIE's tokenizer does

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        out: list[str] = []
        run: list[int] = []
        for index in ids:
            index = int(index)
            if 0 <= index < self.sp_size and index not in self.added and index not in self.special_ids:
                run.append(index)
                continue
            if skip_special_tokens and index in self.special_ids:
                continue
            token = self.id_to_token(index)
            if token is None:
                continue
            if run:
                out.append(self.sp.decode(run))
                run = []
            out.append(token)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def tokens_to_string(self, tokens: Sequence[str], special: set[str]) -> str:
        out: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in special or token in self.added_encoder:
                if run:
                    out.append(self.sp.decode_pieces(run))
                    run = []
                out.append(token)
            else:
                run.append(token)
        if run:
            out.append(self.sp.decode_pieces(run))
        return "".join(out)


class Tokenizer:
    """Encode, decode and chat-template rendering for one checkpoint; see the module docstring."""

    def __init__(self, backend: Any, special_tokens: dict[str, str], extra_special_tokens: list[str],
                 chat_template: str | dict[str, str] | None, add_bos: bool, add_eos: bool,
                 clean_up_tokenization_spaces: bool, name_or_path: str) -> None:
        self._backend = backend
        self._is_sentencepiece = isinstance(backend, _SentencePieceBackend)
        self.special_tokens_map: dict[str, str] = special_tokens
        self.extra_special_tokens = extra_special_tokens
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self._add_bos, self._add_eos = add_bos, add_eos
        self._clean_up = clean_up_tokenization_spaces
        names = list(dict.fromkeys([*special_tokens.values(), *extra_special_tokens]))
        self.all_special_tokens: list[str] = names
        self._special_token_set = set(names)
        self.all_special_ids: list[int] = [i for i in (self.token_to_id(t) for t in names) if i is not None]
        self.vocab_size: int = backend.vocab_size() if self._is_sentencepiece else backend.get_vocab_size(True)
        self.bos_token_id = self._named_id("bos_token")
        self.eos_token_id = self._named_id("eos_token")
        self.pad_token_id = self._named_id("pad_token")
        self.unk_token_id = self._named_id("unk_token")

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str],
                        chat_template: str | os.PathLike[str] | None = None) -> Tokenizer:
        """Load from a directory with tokenizer.json or tokenizer.model (+ tokenizer_config.json)."""
        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(f"tokenizer path {str(path)!r} is not a directory")
        config = _read_json(directory / "tokenizer_config.json")
        special_tokens, extras = _special_tokens(directory, config)
        split = bool(config.get("split_special_tokens", False))
        ordered = list(dict.fromkeys([*special_tokens.values(), *extras]))
        specials = set(ordered)
        if (directory / "tokenizer.json").is_file():
            backend = cls._load_tokenizers(directory / "tokenizer.json", ordered, split)
        elif (directory / "tokenizer.model").is_file():
            backend = cls._load_sentencepiece(directory, config, special_tokens, extras, specials, split)
        else:
            raise ValueError(f"tokenizer path {str(path)!r} has neither tokenizer.json nor tokenizer.model")
        template = resolve_chat_template(chat_template) if chat_template is not None else \
            load_chat_template(directory, config)
        sp = isinstance(backend, _SentencePieceBackend)
        tokenizer = cls(backend, special_tokens, extras, template,
                        add_bos=sp and bool(config.get("add_bos_token", False)),
                        add_eos=sp and bool(config.get("add_eos_token", False)),
                        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                        name_or_path=str(path))
        logger.info("loaded %s tokenizer from %s: vocab %d, bos %s, eos %s", "sentencepiece" if sp else "tokenizers",
                    path, tokenizer.vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id)
        return tokenizer

    @staticmethod
    def _load_tokenizers(file: Path, specials: list[str], split: bool) -> Any:
        from tokenizers import AddedToken as HFAddedToken
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(str(file))
        backend.no_truncation()
        backend.no_padding()
        missing = [t for t in specials if backend.token_to_id(t) is None]
        if missing:  # transformers adds configured special tokens the file lacks, at the end
            backend.add_special_tokens([HFAddedToken(t, special=True, normalized=False) for t in missing])
        backend.encode_special_tokens = split
        return backend

    @staticmethod
    def _load_sentencepiece(directory: Path, config: Mapping[str, Any], special_tokens: dict[str, str],
                            extras: list[str], specials: set[str], split: bool) -> _SentencePieceBackend:
        added: dict[int, AddedToken] = {}
        if "added_tokens_decoder" in config:
            for index, tok in config["added_tokens_decoder"].items():
                added[int(index)] = AddedToken(tok["content"], bool(tok.get("special", False)),
                                               bool(tok.get("lstrip", False)), bool(tok.get("rstrip", False)))
        else:
            for content, index in _read_json(directory / "added_tokens.json").items():
                added[int(index)] = AddedToken(content, special=content in specials)
        backend = _SentencePieceBackend(directory / "tokenizer.model", special_tokens.get("unk_token"), split)
        # Special tokens become added tokens: at their piece id if sentencepiece has them, else appended.
        encoder = {tok.content for tok in added.values()}
        for content in dict.fromkeys([*special_tokens.values(), *extras]):
            if content in encoder:
                continue
            index = backend.token_to_id(content)
            if index is None:
                index = max(backend.sp_size, max(added, default=-1) + 1)
            added[index] = AddedToken(content, special=True)
        # Decoding skips exactly the named and extra special tokens, like transformers' Python tokenizers.
        backend.set_added(added, {i for i, tok in added.items() if tok.content in specials})
        return backend

    # ---- vocabulary ----------------------------------------------------------------------
    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return self.token_to_id(token) if token is not None else None

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab() if self._is_sentencepiece else self._backend.get_vocab(True)

    # ---- encode / decode -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not self._is_sentencepiece:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._backend.encode(text)
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self._add_eos and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._is_sentencepiece:
            text = self._backend.decode(ids, skip_special_tokens)
        else:
            text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
            if self._clean_up and type(self._backend.model).__name__ != "BPE":
                text = _clean_up_tokenization(text)  # transformers never applies this to BPE models
        return text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        to_token = self._backend.id_to_token
        return [tok if (tok := to_token(int(i))) is not None else "" for i in ids]

    def backend_json(self) -> str | None:
        """The `tokenizers` backend serialised as tokenizer.json text (with the added tokens); None for a
        sentencepiece tokenizer. Grammar engines build their token tables from it."""
        return None if self._is_sentencepiece else self._backend.to_str()

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        if self._is_sentencepiece:
            return self._backend.tokens_to_string(tokens, self._special_token_set)
        decoder = self._backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    # ---- chat ----------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | os.PathLike[str] | None = None, tools: Any = None) -> str:
        """The template to use: `chat_template` (text, file, or a name of the tokenizer's templates) or the own one."""
        named = self.chat_template if isinstance(self.chat_template, dict) else {}
        if isinstance(chat_template, RequestTemplate):
            return resolve_chat_template(chat_template)  # a client's text: never a path or a name
        if isinstance(chat_template, str) and chat_template in named:
            return named[chat_template]
        if chat_template is not None:
            return resolve_chat_template(chat_template)
        return select_chat_template(self.chat_template, tools)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render a conversation to text; extra keywords (e.g. enable_thinking, tools) reach the template."""
        source = self.get_chat_template(chat_template, kwargs.get("tools"))
        return render_chat_template(source, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens_map, **kwargs)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    chat_template: str | None = None, **kwargs: Any) -> list[int]:
        """Render and encode a conversation. The template writes BOS/cls itself, so nothing is added (as in
        transformers' and vLLM's chat paths)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
