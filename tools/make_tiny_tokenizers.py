"""Build the two tiny tokenizer fixtures used by the tests and the tiny test models.

Run (from the repository root, about 1 s):

    .venv/bin/python tools/make_tiny_tokenizers.py

Writes
  tests/fixtures/tokenizers/ernie_sp/   tokenizer.model, tokenizer_config.json,
                                        special_tokens_map.json, added_tokens.json
  tests/fixtures/tokenizers/bpe_json/   tokenizer.json, tokenizer_config.json

Both have exactly 1024 ids (0..1023, all decodable), the vocabulary of the tiny test models.

ernie_sp is shaped like ERNIE-4.5-0.3B's tokenizer: a sentencepiece BPE model with byte fallback
holding `<unk>`=0, `<s>`=1, `</s>`=2, `<mask:N>`, `<|begin_of_sentence|>`, `<|end_of_sentence|>`,
`<think>`, `</think>` (whether the real 0.3B vocabulary has the think tokens could not be confirmed;
they are here for reasoning-parser tests); special tokens beyond the model in added_tokens.json
(like the real `<|IMAGE_PLACEHOLDER|>`, `<|LOC_N|>`); the real repo's special-token names (pad =
`<unk>`, cls/sep = begin/end of sentence, mask = `<mask:1>`); and a chat template behaving like the
real 0.3B one (which has no thinking switch). The sentencepiece model keeps text exactly: identity
normalisation, no dummy prefix, repeated whitespace kept; newlines and any character without a
piece become byte tokens, so Chinese and emoji split across byte tokens.

bpe_json is Qwen2-shaped: byte-level BPE trained with `tokenizers` using Qwen2's normaliser,
pre-tokeniser regex and decoder, special `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` and
non-special `<think>`, `</think>` at the end of the vocabulary, and a ChatML template that
honours `enable_thinking` the way Qwen3's does.

Training text is deterministic and offline: docstrings of a fixed list of Python 3.11 standard
library modules plus Chinese lines written below. Training is single-threaded so reruns give
identical files on the same Python version.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import os
import sys
from pathlib import Path

# Single-threaded training keeps merges and piece order reproducible.
os.environ["RAYON_NUM_THREADS"] = "1"

import sentencepiece as spm  # noqa: E402
from tokenizers import (  # noqa: E402
    AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "tokenizers"
VOCAB_SIZE = 1024

MODULES = [
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions",
    "functools", "gettext", "heapq", "html", "http.client", "inspect", "io", "itertools", "json",
    "locale", "logging", "math", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "shutil", "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile",
    "textwrap", "threading", "typing", "unittest", "urllib.parse", "zipfile",
]

CHINESE_LINES = [
    "今天天气很好，我们一起去公园散步吧。",
    "这个程序可以把文本切分成词元，然后再还原成原来的文字。",
    "模型的推理速度取决于内存带宽和计算能力。",
    "请用简单的语言解释一下什么是注意力机制。",
    "我喜欢在安静的晚上读书、写字和听音乐。",
    "春天来了，花开了，小鸟在树上唱歌。",
    "学习编程需要耐心，也需要不断地练习。",
    "你好！很高兴认识你。你今天过得怎么样？",
    "北京是中国的首都，上海是一个很大的城市。",
    "数据越多，模型学到的规律就越丰富。",
    "这是一个测试句子，用来检查分词器是否正确。",
    "他说：“明天早上八点在门口见面。”",
    "人工智能正在改变我们的生活和工作方式。",
    "山高水长，风清月明，一片宁静。",
    "如果遇到问题，请先阅读文档，再提出问题。",
    "文心大模型可以回答问题、写诗和翻译文章。",
]

# Behaves like the ERNIE-4.5-0.3B template: cls token first, "User: ...\n", system text + "\n",
# "Assistant: ..." closed by the sep token, other roles ignored, "Assistant: " as generation prompt.
ERNIE_CHAT_TEMPLATE = (
    "{%- set open = cls_token if cls_token is defined else '<|begin_of_sentence|>' -%}\n"
    "{%- set close = sep_token if sep_token is defined else '<|end_of_sentence|>' -%}\n"
    "{{- open -}}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message['role'] == 'system' -%}\n"
    "        {{- message['content'] + '\\n' -}}\n"
    "    {%- elif message['role'] == 'user' -%}\n"
    "        {{- 'User: ' + message['content'] + '\\n' -}}\n"
    "    {%- elif message['role'] == 'assistant' -%}\n"
    "        {{- 'Assistant: ' + message['content'] + close -}}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt is not defined or add_generation_prompt -%}\n"
    "    {{- 'Assistant: ' -}}\n"
    "{%- endif -%}"
)

# ChatML with Qwen3-style thinking switch, content given as a string or as a list of text parts,
# tools rendered with tojson and unknown roles rejected through raise_exception.
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "{{- '# Tools\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n"
    "{{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('Unknown message role: ' + message.role) }}\n"
    "{%- endif %}\n"
    "{%- if not (tools and loop.first and message.role == 'system') %}\n"
    "{%- if message.content is string %}{%- set text = message.content %}\n"
    "{%- else %}{%- set ns = namespace(text='') %}\n"
    "{%- for part in message.content %}{%- if part.type == 'text' %}"
    "{%- set ns.text = ns.text + part.text %}{%- endif %}{%- endfor %}\n"
    "{%- set text = ns.text %}{%- endif %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' }}\n"
    "{%- if message.role == 'assistant' and message.reasoning_content %}\n"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{{- text + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def corpus_lines() -> list[str]:
    """Docstrings of MODULES (module, public classes/functions and their methods) and CHINESE_LINES."""
    docs: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            docs.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for meth in sorted(vars(obj)):
                    if not meth.startswith("_") and callable(vars(obj)[meth]):
                        docs.append(inspect.getdoc(vars(obj)[meth]) or "")
    lines = [line for doc in docs for line in doc.splitlines() if line.strip()]
    # Repeating the Chinese lines gives their common characters pieces of their own.
    return lines + CHINESE_LINES * 20


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def build_ernie_sp(lines: list[str], out: Path) -> None:
    in_model = ["<mask:%d>" % i for i in range(8)] + [
        "<|begin_of_sentence|>", "<|end_of_sentence|>", "<think>", "</think>",
    ]
    beyond_model = ["<|IMAGE_PLACEHOLDER|>", "<|AUDIO_PLACEHOLDER|>"] + ["<|LOC_%d|>" % i for i in range(4)]
    sp_size = VOCAB_SIZE - len(beyond_model)
    out.mkdir(parents=True, exist_ok=True)
    # Training from an iterator into memory keeps temporary paths out of the saved model proto.
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=sp_size,
        character_coverage=0.9995, byte_fallback=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
        user_defined_symbols=in_model, add_dummy_prefix=False, remove_extra_whitespaces=False,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        input_sentence_size=0, shuffle_input_sentence=False, num_threads=1,
        max_sentence_length=1 << 16, minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert sp.get_piece_size() == sp_size, sp.get_piece_size()
    write_json(out / "added_tokens.json", {tok: sp_size + i for i, tok in enumerate(beyond_model)})
    specials = {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>", "mask_token": "<mask:1>",
    }
    write_json(out / "special_tokens_map.json", {**specials, "additional_special_tokens": beyond_model})
    write_json(out / "tokenizer_config.json", {
        **specials,
        "sys_start_token": "<mask:4>", "sys_end_token": "<mask:5>",
        "header_start_token": "<mask:6>", "header_end_token": "<mask:7>",
        "additional_special_tokens": None,
        "tokenizer_class": "Ernie4_5_Tokenizer",
        "chat_template": ERNIE_CHAT_TEMPLATE,
    })


def build_bpe_json(lines: list[str], out: Path) -> None:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    plain = ["<think>", "</think>"]
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    base_size = VOCAB_SIZE - len(specials) - len(plain)
    trainer = trainers.BpeTrainer(
        vocab_size=base_size, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer=trainer)
    assert tok.get_vocab_size() == base_size, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    decoder = {
        str(base_size + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": t in specials}
        for i, t in enumerate(specials + plain)
    }
    write_json(out / "tokenizer_config.json", {
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })


def main() -> None:
    lines = corpus_lines()
    print(f"corpus: {len(lines)} lines, Python {sys.version.split()[0]}")
    build_ernie_sp(lines, OUT / "ernie_sp")
    build_bpe_json(lines, OUT / "bpe_json")
    print(f"wrote {OUT / 'ernie_sp'} and {OUT / 'bpe_json'}")


if __name__ == "__main__":
    main()
