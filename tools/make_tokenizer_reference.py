"""Record transformers' behaviour on the tokenizer fixtures, for tests/test_tokenizer.py and friends.

Run (from the repository root, after tools/make_tiny_tokenizers.py; a few seconds):

    /work/refvenv/bin/python tools/make_tokenizer_reference.py

Writes tests/fixtures/reference/tokenizer_reference.json: for each fixture the vocabulary size,
special token ids, encodings of assorted texts (with and without special tokens), decodes (skipping
special tokens or not) of those encodings, of every single id and of random id sequences, token
strings, and chat-template renders and encodings (`apply_chat_template`) of several conversations,
including the error raised for a bad role.

How each fixture is loaded:
- bpe_json: `AutoTokenizer.from_pretrained` (transformers' own Qwen2Tokenizer).
- ernie_sp: transformers 5 no longer ships a sentencepiece ERNIE tokenizer (it maps ernie4_5 to
  tokenizer.json only) and the hub's remote-code `Ernie4_5_Tokenizer` targets transformers 4.
  So the reference is transformers' `SentencePieceBackend` (added-token splitting, special-token
  bookkeeping, decode) with ERNIE's one difference in decoding: special tokens are written verbatim
  and only the runs between them go through sentencepiece. The extra `*_token` keys of ERNIE's
  config (`sys_start_token`, ...) are passed as None: transformers 5 would turn such keys into special
  tokens, while ERNIE's tokenizer (and paddleformers) keep them as plain settings. The
  `additional_special_tokens` of special_tokens_map.json are passed explicitly: transformers 5
  drops them when tokenizer_config.json says `"additional_special_tokens": null` (ERNIE's does),
  while transformers 4 and ERNIE's own tokenizer make them special tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import transformers
from transformers import AutoTokenizer
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "tokenizers"
OUT = ROOT / "tests" / "fixtures" / "reference" / "tokenizer_reference.json"

TEXTS = [
    "Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "multiple    spaces  between words",
    "line one\nline two\n\n\tindented\r\nwindows",
    "今天天气很好，我们一起去公园散步吧。",
    "龘靐齉爩 rare characters",
    "emoji 😀🎉 and a flag 🇨🇳 and a family 👨‍👩‍👧",
    "mixed 中文 and English, 标点！？",
    "<|begin_of_sentence|>User: hi\nAssistant: ok<|end_of_sentence|>",
    "<s>bos and eos</s> <unk> <mask:1> <mask:4>",
    "<think>\nreasoning\n</think>\n\nanswer",
    "<|IMAGE_PLACEHOLDER|><|LOC_0|><|LOC_3|> x<|LOC_0|>y",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "partial specials <|begin_of <|im_start <think",
    "def f(x):\n    return x ** 2  # square",
    "Numbers 1234567890 and 3.14159",
    "e\u0301 combining accent and é precomposed",
    "",
    "   ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "你好，请介绍一下你自己。"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke 😀"}],
    [{"role": "user", "content": "multi\nline\n\ncontent  with   spaces"},
     {"role": "assistant", "content": "ok", "tool_calls": None}],
    [{"role": "user", "content": "part one, \n二"}],
]

CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% set ns = namespace(n=loop.index) %}[{{ ns.n }}|{{ m.role | upper }}] "
    "{% generation %}{{ m.content | trim }}{% endgeneration %}\n"
    "{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}{{ dict(a=1) | tojson }}"
)


class ErnieReferenceTokenizer(SentencePieceBackend):
    """transformers' sentencepiece tokenizer decoding special tokens the way ERNIE's does."""

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        specials = set(self.all_special_tokens)
        out, run = [], []
        for token in tokens:
            if token in specials:
                out.append(self.sp_model.decode(run) + token)
                run = []
            else:
                run.append(token)
        return "".join(out) + self.sp_model.decode(run)


def load(name: str):
    path = FIXTURES / name
    if name == "ernie_sp":
        none = dict.fromkeys(["sys_start_token", "sys_end_token", "header_start_token", "header_end_token"])
        extras = json.loads((path / "special_tokens_map.json").read_text())["additional_special_tokens"]
        return ErnieReferenceTokenizer.from_pretrained(str(path), extra_special_tokens=extras, **none)
    return AutoTokenizer.from_pretrained(str(path))


def random_sequences(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(30)]
    return seqs


def chat_cases(name: str) -> list[dict]:
    cases = []
    for messages in CONVERSATIONS:
        for add_gen in (True, False):
            cases.append({"messages": messages, "add_generation_prompt": add_gen, "kwargs": {}})
            for thinking in (True, False):
                cases.append({"messages": messages, "add_generation_prompt": add_gen,
                              "kwargs": {"enable_thinking": thinking}})
    cases.append({"messages": CONVERSATIONS[2], "add_generation_prompt": True, "kwargs": {},
                  "chat_template": CUSTOM_TEMPLATE})
    if name == "bpe_json":
        parts = [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "二"}]}]
        cases.append({"messages": parts, "add_generation_prompt": True, "kwargs": {}})
        reasoning = [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": "a", "reasoning": "\nthink first\n"},
                     {"role": "user", "content": "q2"}]
        cases.append({"messages": reasoning, "add_generation_prompt": True, "kwargs": {"enable_thinking": False}})
        tools = [{"type": "function", "function": {"name": "天气", "description": "Get the weather <now>",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        cases.append({"messages": CONVERSATIONS[1], "add_generation_prompt": True, "kwargs": {"tools": tools}})
    return cases


def record(name: str) -> dict:
    tok = load(name)
    vocab = len(tok)
    result: dict = {
        "class": type(tok).__name__,
        "vocab_size": vocab,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "all_special_ids": list(tok.all_special_ids),
        "all_special_tokens": list(tok.all_special_tokens),
        "special_tokens_map": dict(tok.special_tokens_map),
    }
    result["encode"] = [
        {"text": t, "ids": tok.encode(t, add_special_tokens=True),
         "ids_no_special": tok.encode(t, add_special_tokens=False)}
        for t in TEXTS
    ]
    sequences = [e["ids"] for e in result["encode"]] + random_sequences(vocab, seed=len(name))
    result["decode"] = [
        {"ids": ids, "skip": tok.decode(ids, skip_special_tokens=True),
         "keep": tok.decode(ids, skip_special_tokens=False)}
        for ids in sequences
    ]
    result["single_id_decode"] = [tok.decode([i], skip_special_tokens=False) for i in range(vocab)]
    result["tokens"] = []
    for ids in sequences[:12]:
        tokens = tok.convert_ids_to_tokens(ids)
        result["tokens"].append({"ids": ids, "tokens": tokens, "string": tok.convert_tokens_to_string(tokens)})
    result["chat"] = []
    for case in chat_cases(name):
        args = dict(add_generation_prompt=case["add_generation_prompt"], chat_template=case.get("chat_template"),
                    **case["kwargs"])
        text = tok.apply_chat_template(case["messages"], tokenize=False, **args)
        ids = tok.apply_chat_template(case["messages"], tokenize=True, return_dict=False, **args)
        result["chat"].append({**case, "text": text, "ids": list(ids)})
    bad = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
    try:
        tok.apply_chat_template(bad, tokenize=False, chat_template=CHAT_ERROR_TEMPLATE if name == "ernie_sp" else None)
        error = None
    except Exception as exc:  # transformers raises jinja2's TemplateError with the template's message
        error = str(exc)
    result["chat_error"] = {"messages": bad, "chat_template": CHAT_ERROR_TEMPLATE if name == "ernie_sp" else None,
                            "error": error}
    return result


# ERNIE's template ignores unknown roles, so its error case uses a template that rejects them.
CHAT_ERROR_TEMPLATE = (
    "{% for m in messages %}{% if m.role not in ('user', 'assistant') %}"
    "{{ raise_exception('Role ' + m.role + ' is not supported') }}{% endif %}{{ m.content }}{% endfor %}"
)


def main() -> None:
    data = {"transformers_version": transformers.__version__,
            "fixtures": {name: record(name) for name in ("ernie_sp", "bpe_json")}}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for name, fx in data["fixtures"].items():
        print(name, fx["class"], "vocab", fx["vocab_size"], "special ids", fx["all_special_ids"])
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
