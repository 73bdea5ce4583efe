"""Record transformers' chat-template renders with tools, for tests/test_tool_calling.py.

Run from the repository root in a separate venv with transformers (no torch needed):

    python3 -m venv /work/refenv
    /work/refenv/bin/pip install transformers jinja2 sentencepiece tokenizers
    /work/refenv/bin/python tools/make_tool_calling_reference.py

Writes tests/fixtures/reference/tool_calling_reference.json: for each fixture model's tokenizer, each
template (the model's own, and the tool templates in tests/fixtures/templates/) and each conversation
(tools in the prompt, assistant tool_calls with arguments as a JSON string or an object, tool results),
the text and ids of `apply_chat_template(messages, tools=..., ...)`, or the fact that it raised.
The ERNIE fixtures are loaded as tools/make_tokenizer_reference.py loads its ERNIE tokenizer.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import transformers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from make_tokenizer_reference import ErnieReferenceTokenizer  # noqa: E402

MODELS = ROOT / "tests" / "fixtures" / "models"
TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
OUT = ROOT / "tests" / "fixtures" / "reference" / "tool_calling_reference.json"
FIXTURES = ["qwen3_tiny", "ernie45_tiny_hf", "ernie45_vl_tiny_hf"]
TEMPLATE_FILES = ["hermes_tools.jinja", "ernie_x1_tools.jinja"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C) — <b>& \"quotes\"</b>",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "城市名"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}}}}}
NO_PARAMS = {"type": "function", "function": {"name": "now"}}

CALL_STR = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"巴黎\", \"unit\": \"celsius\"}"}}
CALL_OBJ = {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": {"query": "x", "top_k": 3}}}

CASES = [
    {"name": "user_only", "tools": [WEATHER, SEARCH],
     "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    {"name": "system_and_tools", "tools": [WEATHER, NO_PARAMS],
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Time?"}]},
    {"name": "call_and_result", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [CALL_STR]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                  {"role": "user", "content": "And tomorrow?"}]},
    {"name": "two_calls_with_text", "tools": [WEATHER, SEARCH],
     "messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "Both please"},
                  {"role": "assistant", "content": "Calling two tools.", "tool_calls": [CALL_STR, CALL_OBJ]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                  {"role": "tool", "tool_call_id": "call_2", "content": "[\"result\"]"}]},
    {"name": "no_tools_given", "tools": None,
     "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "bye"}]},
    {"name": "empty_tools", "tools": [], "messages": [{"role": "user", "content": "hi"}]},
]


def load(name: str):
    path = MODELS / name
    if (path / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(path))
    none = dict.fromkeys(["sys_start_token", "sys_end_token", "header_start_token", "header_end_token"])
    extras = json.loads((path / "special_tokens_map.json").read_text())["additional_special_tokens"]
    return ErnieReferenceTokenizer.from_pretrained(str(path), extra_special_tokens=extras, **none)


def record(tok, case: dict, template: str | None, kwargs: dict) -> dict:
    args = dict(tools=case["tools"], add_generation_prompt=True, chat_template=template, **kwargs)
    entry = {"case": case["name"], "template": None, "kwargs": kwargs}
    try:
        entry["text"] = tok.apply_chat_template(case["messages"], tokenize=False, **args)
        entry["ids"] = tok.apply_chat_template(case["messages"], tokenize=True, return_dict=False, **args)
    except Exception as e:  # noqa: BLE001 - the test checks that ours refuses the same input
        entry["error"] = f"{type(e).__name__}: {e}"
    return entry


def main() -> None:
    fixtures = {}
    for name in FIXTURES:
        tok = load(name)
        entries = []
        for template_name in [None, *TEMPLATE_FILES]:
            template = (TEMPLATES / template_name).read_text(encoding="utf-8") if template_name else None
            for case in CASES:
                for kwargs in ({}, {"enable_thinking": False}):
                    entry = record(tok, case, template, kwargs)
                    entry["template"] = template_name
                    entries.append(entry)
        fixtures[name] = entries
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "cases": CASES, "fixtures": fixtures},
                              ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({sum(len(v) for v in fixtures.values())} renders)")


if __name__ == "__main__":
    main()
