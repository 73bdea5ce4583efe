"""Record transformers' chat-template renders for tests/test_chat_template_reference.py (llm.chat's prompts).

Run from the repository root with the reference venv (transformers, no torch; a few seconds):

    /work/refenv/bin/python tools/make_chat_template_reference.py

Writes tests/fixtures/reference/chat_template_reference.json: for every fixture tokenizer and model with a
chat template, `apply_chat_template(..., tokenize=False)` of several conversations with each template (the
fixture's own; on the two tokenizer fixtures also, as `chat_template` overrides, the tool templates of
tests/fixtures/templates/, a custom one and one that trims contents, their texts stored under "templates"),
each of add_generation_prompt True/False and continue_final_message, and enable_thinking absent / True /
False. Cases transformers refuses are recorded with its error message. The tokenizers are loaded as
tools/make_tokenizer_reference.py loads them (see its docstring for the ERNIE sentencepiece fixtures).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tokenizer_reference import CONVERSATIONS, CUSTOM_TEMPLATE, ErnieReferenceTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
OUT = FIXTURES / "reference" / "chat_template_reference.json"
SOURCES = ["tokenizers/bpe_json", "tokenizers/ernie_sp", "models/ernie45_tiny_hf", "models/ernie45_moe_tiny_hf",
           "models/ernie45_vl_tiny_hf", "models/qwen2_tiny", "models/qwen3_tiny"]
OVERRIDES = {"custom": CUSTOM_TEMPLATE,
             "ernie_x1_tools": (FIXTURES / "templates" / "ernie_x1_tools.jinja").read_text(encoding="utf-8"),
             "hermes_tools": (FIXTURES / "templates" / "hermes_tools.jinja").read_text(encoding="utf-8"),
             # trims each content: a final message's trailing spaces are cut with it
             "trimming": ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")}

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
    special tokens differ: bpe_json has no BOS, ernie_sp has)."""
    result = []
    for template_name in [None, *OVERRIDES] if source.startswith("tokenizers/") else [None]:
        for messages in CONVERSATIONS[:4] + TO_CONTINUE:
            for mode in modes(messages):
                refused = mode["add_generation_prompt"] and mode.get("continue_final_message")
                for thinking in (None,) if refused else (None, True, False):
                    kwargs = dict(mode) | ({} if thinking is None else {"enable_thinking": thinking})
                    result.append({"source": source, "chat_template": template_name, "messages": messages,
                                   "kwargs": kwargs})
    return result


def main() -> None:
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
    head = json.dumps({"transformers": transformers.__version__, "templates": OVERRIDES}, ensure_ascii=False)
    OUT.write_text(f'{head[:-1]}, "cases": [\n{lines}\n]}}\n', encoding="utf-8")
    print(f"wrote {len(entries)} cases ({sum('error' in e for e in entries)} refused) to {OUT}")


if __name__ == "__main__":
    main()
