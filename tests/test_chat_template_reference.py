"""llm.chat's prompts against transformers' apply_chat_template (chat_template_reference.json, made by
tools/make_chat_template_reference.py): every fixture template, chat_template overrides, enable_thinking,
add_generation_prompt and continue_final_message, byte for byte; what transformers refuses is refused.
The models' own tool templates (Llama 3.1 / 3.2, Mistral-7B-Instruct-v0.3, Qwen3) also with tools, tool calls,
tool results and their keywords (date_string, tools_in_user_message, builtin_tools, custom_tools); the clock
`strftime_now` reads is pinned to the one the reference saw."""
from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.entrypoints.prompts import render_chat_text
from fastdeploy.input import chat_template
from fastdeploy.input.chat_template import render_chat_template
from fastdeploy.input.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = json.loads((FIXTURES / "reference" / "chat_template_reference.json").read_text(encoding="utf-8"))
CASES = REFERENCE["cases"]
OVERRIDES = REFERENCE["templates"]  # chat_template overrides by name
MODEL_TEMPLATES = ["llama3_1_tools", "llama3_2_tools", "mistral_v0_3_tools", "qwen3_tools"]


class _ReferenceClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.fromisoformat(REFERENCE["now"])


@pytest.fixture(autouse=True)
def reference_clock(monkeypatch):
    """strftime_now reads the clock the reference was rendered at (Llama 3.2's template prints today's date)."""
    monkeypatch.setattr(chat_template, "datetime", _ReferenceClock)


@cache
def tokenizer(source: str) -> Tokenizer:
    return Tokenizer.from_pretrained(FIXTURES / source)


def template_of(case: dict) -> str | None:
    return None if case["chat_template"] is None else OVERRIDES[case["chat_template"]]


def test_reference_covers_every_fixture_template_and_mode():
    sources = {c["source"] for c in CASES}
    assert sources == {f"tokenizers/{p.name}" for p in (FIXTURES / "tokenizers").iterdir()} | {
        f"models/{p.name}" for p in (FIXTURES / "models").iterdir() if not p.name.endswith("_paddle")}
    assert {c["chat_template"] for c in CASES} == {None, *OVERRIDES}
    for path in (FIXTURES / "templates").iterdir():  # the tool templates as the fixtures hold them
        assert OVERRIDES[path.stem] == path.read_text(encoding="utf-8")
    kwargs = [c["kwargs"] for c in CASES if "text" in c]
    assert {k.get("enable_thinking") for k in kwargs} == {None, True, False}
    assert {(k["add_generation_prompt"], k.get("continue_final_message", False)) for k in kwargs} == {
        (True, False), (False, False), (False, True)}
    for name in MODEL_TEMPLATES:  # each model's template with tools, calls and results, and its keywords
        rendered = [c for c in CASES if c["chat_template"] == name and "text" in c and "tools" in c["kwargs"]]
        assert {m["role"] for c in rendered for m in c["messages"]} == {"system", "user", "assistant", "tool"}
        assert any(m.get("tool_calls") for c in rendered for m in c["messages"])
        assert {k for c in rendered for k in c["kwargs"]} >= {"date_string", "tools_in_user_message", "builtin_tools",
                                                              "custom_tools", "add_generation_prompt"}
    llama32 = [c for c in CASES if c["chat_template"] == "llama3_2_tools" and "text" in c]
    today = datetime.fromisoformat(REFERENCE["now"]).strftime("%d %b %Y")
    assert any(f"Today Date: {today}" in c["text"] for c in llama32)  # strftime_now was called
    assert any("<|python_tag|>brave_search.call(" in c["text"] for c in CASES if "text" in c)  # builtin tools
    assert any("[TOOL_CALLS] [" in c["text"] for c in CASES if "text" in c)


@pytest.mark.parametrize("source", sorted({c["source"] for c in CASES}))
def test_llm_chat_prompts_match_transformers(source):
    tok, checked = tokenizer(source), 0
    for case in (c for c in CASES if c["source"] == source):
        args = (tok, case["messages"], dict(case["kwargs"]), template_of(case))
        if "error" in case:
            with pytest.raises(ValueError):
                render_chat_text(*args)
        else:
            assert render_chat_text(*args) == case["text"], case
            checked += 1
    assert checked >= 50


def test_continue_final_message_alone_leaves_out_the_generation_prompt():
    # transformers needs add_generation_prompt=False with it; llm.chat (whose default is True) infers it.
    tok = tokenizer("tokenizers/bpe_json")
    case = next(c for c in CASES if c["source"] == "tokenizers/bpe_json" and c["chat_template"] is None
                and c["kwargs"] == {"add_generation_prompt": False, "continue_final_message": True})
    assert render_chat_text(tok, case["messages"], {"continue_final_message": True}) == case["text"]
    assert case["text"].endswith(case["messages"][-1]["content"])


def test_continue_final_message_refusals():
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(ValueError, match="never reads"):
        render_chat_template("{% for m in messages %}{{ m.role }}{% endfor %}", messages, add_generation_prompt=False,
                             continue_final_message=True)
    with pytest.raises(ValueError, match="drops"):
        render_chat_template("{{ messages[0].content }}", messages, add_generation_prompt=False,
                             continue_final_message=True)
    with pytest.raises(NotImplementedError, match="continue_final_message"):
        render_chat_template("{{ messages }}", messages, add_generation_prompt=False,
                             continue_final_message="reasoning")


def test_llm_chat_uses_these_prompts(tiny_hf):
    llm = LLM(model=tiny_hf, block_size=16, max_num_seqs=4)
    source = "models/" + Path(tiny_hf).name
    picked = [c for c in CASES if c["source"] == source and "text" in c and c["messages"][-1]["role"] == "assistant"]
    picked = [next(c for c in picked if c["kwargs"].get("continue_final_message")),
              next(c for c in picked if c["kwargs"] == {"add_generation_prompt": False, "enable_thinking": False})]
    for case in picked:
        out = llm.chat(case["messages"], SamplingParams(max_tokens=1), use_tqdm=False,
                       chat_template_kwargs=dict(case["kwargs"]))[0]
        assert out.prompt == case["text"]
        assert out.prompt_token_ids == llm.get_tokenizer().encode(case["text"], add_special_tokens=False)
