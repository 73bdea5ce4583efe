"""Tokenizer against transformers' results on the tiny fixtures (tests/fixtures/reference/tokenizer_reference.json,
made by tools/make_tokenizer_reference.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fastdeploy.input.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZERS = FIXTURES / "tokenizers"






def test_special_tokens_and_sizes(case):
    tok, ref = case
    assert tok.vocab_size == ref["vocab_size"] == 1024
    assert len(tok) == ref["vocab_size"]
    assert tok.bos_token_id == ref["bos_token_id"]
    assert tok.eos_token_id == ref["eos_token_id"]
    assert tok.pad_token_id == ref["pad_token_id"]
    assert tok.all_special_ids == ref["all_special_ids"]
    assert tok.all_special_tokens == ref["all_special_tokens"]
    assert tok.special_tokens_map == ref["special_tokens_map"]


def test_encode_matches_transformers(case):
    tok, ref = case
    for entry in ref["encode"]:
        assert tok.encode(entry["text"]) == entry["ids"], entry["text"]
        assert tok.encode(entry["text"], add_special_tokens=False) == entry["ids_no_special"], entry["text"]


def test_decode_matches_transformers(case):
    tok, ref = case
    for entry in ref["decode"]:
        assert tok.decode(entry["ids"], skip_special_tokens=True) == entry["skip"], entry["ids"]
        assert tok.decode(entry["ids"], skip_special_tokens=False) == entry["keep"], entry["ids"]
        assert tok.decode(entry["ids"]) == entry["skip"]  # skipping is the default here, as in FastDeploy


def test_every_id_decodes_like_transformers(case):
    tok, ref = case
    assert [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)] == ref["single_id_decode"]


def test_tokens_and_token_strings(case):
    tok, ref = case
    for entry in ref["tokens"]:
        assert tok.convert_ids_to_tokens(entry["ids"]) == entry["tokens"]
        assert tok.convert_tokens_to_string(entry["tokens"]) == entry["string"]


def test_roundtrip_of_plain_text(case):
    tok, ref = case
    for entry in ref["encode"]:
        if not any(t in entry["text"] for t in ref["all_special_tokens"]):
            assert tok.decode(entry["ids"]) == entry["text"] or "\u0301" in entry["text"]


def test_special_tokens_in_text_are_single_ids(case):
    tok, _ = case
    for token in tok.all_special_tokens:
        ids = tok.encode(f"a{token}b", add_special_tokens=False)
        assert tok.token_to_id(token) in ids
        assert tok.decode(ids, skip_special_tokens=False) == f"a{token}b"


def test_missing_or_bad_directory(tmp_path):
    with pytest.raises(ValueError, match="neither tokenizer.json nor tokenizer.model"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_encode_rejects_non_text(case):
    tok, _ = case
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode([1, 2, 3])


def test_tokenizer_json_wins_over_sentencepiece(tmp_path, reference):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZERS / "bpe_json" / name, tmp_path / name)
    shutil.copy(TOKENIZERS / "ernie_sp" / "tokenizer.model", tmp_path / "tokenizer.model")
    tok = Tokenizer.from_pretrained(tmp_path)
    for entry in reference["bpe_json"]["encode"]:
        assert tok.encode(entry["text"]) == entry["ids"]


def test_chat_template_file_and_override(tmp_path, reference):
    ref_case = next(c for c in reference["ernie_sp"]["chat"] if c.get("chat_template"))
    shutil.copytree(TOKENIZERS / "ernie_sp", tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text(ref_case["chat_template"], encoding="utf-8")
    # chat_template.jinja beats tokenizer_config.json's template, as in transformers
    tok = Tokenizer.from_pretrained(tmp_path / "tok")
    assert tok.apply_chat_template(ref_case["messages"]) == ref_case["text"]
    # an explicit template (a file path here) beats both
    plain = next(c for c in reference["ernie_sp"]["chat"] if not c.get("chat_template") and not c["kwargs"])
    (tmp_path / "ernie.jinja").write_text(
        json.loads((TOKENIZERS / "ernie_sp" / "tokenizer_config.json").read_text())["chat_template"], encoding="utf-8")
    tok = Tokenizer.from_pretrained(tmp_path / "tok", chat_template=tmp_path / "ernie.jinja")
    rendered = tok.apply_chat_template(plain["messages"], add_generation_prompt=plain["add_generation_prompt"])
    assert rendered == plain["text"]
