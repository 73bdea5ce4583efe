"""Chat-template rendering against transformers' apply_chat_template (tokenizer_reference.json), plus the
sandbox and input rules transformers applies."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from fastdeploy.input.chat_template import detect_content_format, render_chat_template, resolve_chat_template
from fastdeploy.input.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"






def test_renders_and_ids_match_transformers(case):
    tok, ref = case
    assert len(ref["chat"]) > 20
    for entry in ref["chat"]:
        args = dict(add_generation_prompt=entry["add_generation_prompt"], chat_template=entry.get("chat_template"),
                    **entry["kwargs"])
        assert tok.apply_chat_template(entry["messages"], **args) == entry["text"], entry
        assert tok.encode_chat(entry["messages"], **args) == entry["ids"], entry


def test_template_errors_become_value_errors(case):
    tok, ref = case
    err = ref["chat_error"]
    with pytest.raises(ValueError) as info:
        tok.apply_chat_template(err["messages"], chat_template=err["chat_template"])
    assert str(info.value) == err["error"]


def test_encode_chat_adds_no_second_bos(reference):
    tok = Tokenizer.from_pretrained(FIXTURES / "tokenizers" / "ernie_sp")
    entry = next(c for c in reference["ernie_sp"]["chat"] if c.get("chat_template"))  # starts with {{ bos_token }}
    ids = tok.encode_chat(entry["messages"], chat_template=entry["chat_template"])
    assert ids == entry["ids"] and ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id


def test_text_parts_are_joined_for_string_templates(reference):
    # ERNIE's template concatenates message["content"]: a list of text parts is joined with newlines (as vLLM
    # does), which must render exactly like transformers did for the joined string.
    tok = Tokenizer.from_pretrained(FIXTURES / "tokenizers" / "ernie_sp")
    assert detect_content_format(tok.chat_template) == "string"
    entry = next(c for c in reference["ernie_sp"]["chat"] if c["messages"][0]["content"] == "part one, \n二")
    parts = [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "二"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=entry["add_generation_prompt"]) == entry["text"]
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_parts_templates_keep_lists():
    tok = Tokenizer.from_pretrained(FIXTURES / "tokenizers" / "bpe_json")
    assert detect_content_format(tok.chat_template) == "openai"


def test_strftime_now_and_kwargs_override_special_tokens():
    out = render_chat_template("{{ strftime_now('%Y-%m') }}|{{ bos_token }}|{{ eos_token }}",
                               [{"role": "user", "content": "x"}],
                               special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, eos_token="END")
    assert out == f"{datetime.now():%Y-%m}|<s>|END"


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_hidden=1) %}",            # underscore attributes are refused
    "{{ messages.append(1) }}",                      # the environment is immutable
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # no way out of the sandbox
    "{{ messages[0].content + 1 }}",                 # type errors in the template
    "{% for m in messages %}",                       # syntax errors
])
def test_unsafe_or_broken_templates_raise_value_error(template):
    with pytest.raises(ValueError):
        render_chat_template(template, [{"role": "user", "content": "x"}])


def test_message_validation():
    with pytest.raises(ValueError, match="at least one message"):
        render_chat_template("{{ messages }}", [])
    with pytest.raises(TypeError, match="messages"):
        render_chat_template("{{ messages }}", "hello")
    with pytest.raises(TypeError, match=r"messages\[1\]"):
        render_chat_template("{{ messages }}", [{"role": "user", "content": "x"}, "y"])


def test_resolve_chat_template(tmp_path):
    file = tmp_path / "t.jinja"
    file.write_text("{{ 1 }}", encoding="utf-8")
    assert resolve_chat_template(file) == "{{ 1 }}"
    assert resolve_chat_template(str(file)) == "{{ 1 }}"
    assert resolve_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="neither an existing file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(TypeError, match="chat_template"):
        resolve_chat_template(3)


def test_tokenizer_without_template_asks_for_one(tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((FIXTURES / "tokenizers" / "bpe_json" / name).read_bytes())
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
