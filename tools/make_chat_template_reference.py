"""Record transformers' chat-template renders for tests/test_chat_template_reference.py (llm.chat's prompts).

Run from the repository root with the reference venv (transformers, no torch; a few seconds):

    /work/llama/venv/bin/python tools/make_chat_template_reference.py

Writes tests/fixtures/reference/chat_template_reference.json: for every fixture tokenizer and model with a
chat template, `apply_chat_template(..., tokenize=False)` of several conversations with each template (the
fixture's own; on the two tokenizer fixtures also, as `chat_template` overrides, the tool templates of
tests/fixtures/templates/, a custom one and one that trims contents, their texts stored under "templates"),
each of add_generation_prompt True/False and continue_final_message, and enable_thinking absent / True /
False. Cases transformers refuses are recorded with its error message. The tokenizers are loaded as
tools/make_tokenizer_reference.py loads them (see its docstring for the ERNIE sentencepiece fixtures).

The models' own tool-calling templates, as their checkpoints carry them (tokenizer_config.json's
`chat_template`), are fixtures too, byte for byte:
- llama3_1_tools.jinja: meta-llama/Llama-3.1-8B-Instruct (fixed default date, builtin_tools, custom_tools),
- llama3_2_tools.jinja: meta-llama/Llama-3.2-3B-Instruct (date from strftime_now; as llama.cpp's
  models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja),
- mistral_v0_3_tools.jinja: mistralai/Mistral-7B-Instruct-v0.3 ([AVAILABLE_TOOLS], [TOOL_CALLS],
  [TOOL_RESULTS], 9-character call ids),
- qwen3_tools.jinja: Qwen/Qwen3 (Qwen3-0.6B ... Qwen3-30B-A3B; as llama.cpp's Qwen-Qwen3-0.6B.jinja).
Besides the conversations above (without None-valued keys, on which Llama's template fails in transformers,
while ours drops such keys), they render TOOL_CONVERSATIONS (tools given, system prompts, several turns,
assistant tool calls with arguments as an object or a JSON string, one and two calls, tool results) under
TOOL_KWARGS (date_string, tools_in_user_message, builtin_tools, custom_tools, enable_thinking). The clock
that `strftime_now` reads is pinned to NOW (recorded as "now"; the test pins ours to it).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

import transformers
import transformers.utils.chat_template_utils as chat_template_utils
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tokenizer_reference import CONVERSATIONS, CUSTOM_TEMPLATE, ErnieReferenceTokenizer  # noqa: E402
from make_tool_calling_reference import SEARCH, WEATHER  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
OUT = FIXTURES / "reference" / "chat_template_reference.json"
# Every tokenizer fixture and every Hugging Face model fixture (the _paddle ones hold the same tokenizers).
SOURCES = sorted(f"{kind}/{p.name}" for kind in ("tokenizers", "models") for p in (FIXTURES / kind).iterdir()
                 if p.is_dir() and not p.name.endswith("_paddle"))
OVERRIDES = {"custom": CUSTOM_TEMPLATE,
             "ernie_x1_tools": (FIXTURES / "templates" / "ernie_x1_tools.jinja").read_text(encoding="utf-8"),
             "hermes_tools": (FIXTURES / "templates" / "hermes_tools.jinja").read_text(encoding="utf-8"),
             # trims each content: a final message's trailing spaces are cut with it
             "trimming": ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")}
MODEL_TEMPLATES = ["llama3_1_tools", "llama3_2_tools", "mistral_v0_3_tools", "qwen3_tools"]
OVERRIDES |= {name: (FIXTURES / "templates" / f"{name}.jinja").read_text(encoding="utf-8") for name in MODEL_TEMPLATES}
NOW = datetime(2025, 2, 3, 12, 0, 0)  # what strftime_now sees


class _PinnedClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return NOW


# Mistral's template wants call ids of 9 letters and digits.
CALL_OBJ = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"city": "巴黎", "unit": "celsius"}}}
CALL_STR = {"id": "xyz987UVW", "type": "function",
            "function": {"name": "search", "arguments": "{\"query\": \"Paris \\\"events\\\"\", \"top_k\": 3}"}}
CALL_BUILTIN = {"id": "brv000001", "type": "function",
                "function": {"name": "brave_search", "arguments": {"query": "weather Paris"}}}
TOOL_CONVERSATIONS = [
    {"tools": [WEATHER, SEARCH], "messages": [
        {"role": "system", "content": "You are a helpful assistant. "},
        {"role": "user", "content": "Weather in Paris?"}]},
    {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Weather in 巴黎?"}]},
    {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL_OBJ]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "{\"temp\": 21}"}]},
    {"tools": [WEATHER, SEARCH], "messages": [
        {"role": "system", "content": "You help."}, {"role": "user", "content": "Events?"},
        {"role": "assistant", "content": "Searching.", "tool_calls": [CALL_STR]},
        {"role": "tool", "tool_call_id": "xyz987UVW", "content": "[\"a fair\"]"},
        {"role": "assistant", "content": "There is a fair."}, {"role": "user", "content": "Thanks"}]},
    {"tools": [WEATHER, SEARCH], "messages": [
        {"role": "user", "content": "Both please"},
        {"role": "assistant", "content": "", "tool_calls": [CALL_OBJ, CALL_STR]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"},
        {"role": "tool", "tool_call_id": "xyz987UVW", "content": "nothing"}]},
    {"tools": [SEARCH], "messages": [
        {"role": "user", "content": "Search the weather"},
        {"role": "assistant", "content": "", "tool_calls": [CALL_BUILTIN]},
        {"role": "tool", "tool_call_id": "brv000001", "content": "sunny"}]},
    {"tools": None, "messages": [{"role": "user", "content": "No tools here"}]},
]
TOOL_KWARGS = [{}, {"date_string": "26 Sep 2024"}, {"tools_in_user_message": False},
               {"builtin_tools": ["brave_search", "wolfram_alpha"]}, {"custom_tools": [SEARCH]},
               {"enable_thinking": False}]

# Conversations ending with an assistant message, to continue: content kept as is, with trailing spaces
# (which some templates trim), and after a reasoning part.
TO_CONTINUE = [
    [{"role": "user", "content": "Write a haiku about rain."},
     {"role": "assistant", "content": "Soft rain on the roof,"}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Count to three"},
     {"role": "assistant", "content": "Un, deux,   "}],
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "The answer is", "reasoning_content": "simple sum"}],
]


def load(source: str):
    path = FIXTURES / source
    if (path / "tokenizer.model").exists():
        none = dict.fromkeys(["sys_start_token", "sys_end_token", "header_start_token", "header_end_token"])
        extras = json.loads((path / "special_tokens_map.json").read_text())["additional_special_tokens"]
        return ErnieReferenceTokenizer.from_pretrained(str(path), extra_special_tokens=extras, **none)
    return AutoTokenizer.from_pretrained(str(path))


def modes(messages: list[dict]) -> list[dict]:
    """The (add_generation_prompt, continue_final_message) combinations worth recording for `messages`."""
    out = [{"add_generation_prompt": True}, {"add_generation_prompt": False}]
    if messages[-1]["role"] == "assistant":
        out += [{"add_generation_prompt": False, "continue_final_message": True},
                {"add_generation_prompt": True, "continue_final_message": True}]  # refused
    return out


def cases(source: str) -> list[dict]:
    """The fixture's own template on every source; the overrides on the two tokenizer fixtures (their
    special tokens differ: bpe_json has no BOS, ernie_sp has), the models' templates also with tools."""
    result = []
    for template_name in [None, *OVERRIDES] if source.startswith("tokenizers/") else [None]:
        conversations = CONVERSATIONS[:4] + TO_CONTINUE
        if template_name in MODEL_TEMPLATES:
            conversations = [c for c in conversations if all(None not in m.values() for m in c)]
            result += [{"source": source, "chat_template": template_name, "messages": conv["messages"],
                        "kwargs": {"tools": conv["tools"], "add_generation_prompt": generation, **kwargs}}
                       for conv in TOOL_CONVERSATIONS for kwargs in TOOL_KWARGS for generation in (True, False)]
        for messages in conversations:
            for mode in modes(messages):
                refused = mode["add_generation_prompt"] and mode.get("continue_final_message")
                for thinking in (None,) if refused else (None, True, False):
                    kwargs = dict(mode) | ({} if thinking is None else {"enable_thinking": thinking})
                    result.append({"source": source, "chat_template": template_name, "messages": messages,
                                   "kwargs": kwargs})
    return result


def main() -> None:
    chat_template_utils.datetime = _PinnedClock
    entries = []
    for source in SOURCES:
        tok = load(source)
        for case in cases(source):
            template = OVERRIDES.get(case["chat_template"])
            try:
                text = tok.apply_chat_template(case["messages"], tokenize=False, chat_template=template,
                                               **case["kwargs"])
                entries.append({**case, "text": text})
            except Exception as exc:  # noqa: BLE001 - transformers' refusal is the recorded result
                entries.append({**case, "error": f"{type(exc).__name__}: {exc}"})
    lines = ",\n".join(json.dumps(e, ensure_ascii=False) for e in entries)  # one case a line
    head = json.dumps({"transformers": transformers.__version__, "now": NOW.isoformat(), "templates": OVERRIDES},
                      ensure_ascii=False)
    OUT.write_text(f'{head[:-1]}, "cases": [\n{lines}\n]}}\n', encoding="utf-8")
    print(f"wrote {len(entries)} cases ({sum('error' in e for e in entries)} refused) to {OUT}")


if __name__ == "__main__":
    main()
