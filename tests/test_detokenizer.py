"""IncrementalDetokenizer: deltas join to the full decode (transformers' decode from tokenizer_reference.json
where recorded), never split a character, and each step decodes only a short window."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.engine.output_processor import IncrementalDetokenizer

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ("ernie_sp", "bpe_json")
TEXTS = [
    "你好😀 世界🎉！今天天气很好。",
    "龘靐齉爩 👨‍👩‍👧 🇨🇳 é e\u0301",
    "Hello  world\n\n\tcode: x ** 2",
    "<think>\n想一想\n</think>\n\n答案是 42。",
]




@pytest.fixture(scope="module", params=NAMES)
def tok(request) -> Tokenizer:
    return Tokenizer.from_pretrained(FIXTURES / "tokenizers" / request.param)


def chunked(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    if rng is None:
        return [[i] for i in ids]
    out, pos = [], 0
    while pos < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[pos:pos + n])
        pos += n
    return out


def run(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool, rng: random.Random | None) -> list[str]:
    """Feed ids, check the invariants after every step, return all deltas (the flush last)."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    final = tok.decode(ids, skip_special_tokens=skip)
    deltas = []
    for chunk in chunked(ids, rng):
        deltas.append(detok.add_tokens(chunk))
        assert final.startswith(detok.text)  # never text that a later token would change
        if "\ufffd" in deltas[-1]:
            assert "\ufffd" in final
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas) == final
    return deltas


def test_deltas_join_to_transformers_decode(tok, reference):
    ref = reference[Path(tok.name_or_path).name]
    rng = random.Random(0)
    for entry in ref["decode"]:
        for skip, key in ((True, "skip"), (False, "keep")):
            for mode in (None, rng):
                detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
                text = "".join(detok.add_tokens(c) for c in chunked(entry["ids"], mode)) + detok.flush()
                assert text == entry[key], entry["ids"]


@pytest.mark.parametrize("skip", [True, False])
def test_multibyte_text_one_and_several_tokens_at_a_time(tok, skip):
    rng = random.Random(1)
    prompt = tok.encode("User: 写一首诗\nAssistant: ", add_special_tokens=False)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for mode in (None, rng):
            deltas = run(tok, prompt, ids, skip, mode)
            assert not any("\ufffd" in d for d in deltas)


def test_byte_tokens_are_held_until_the_character_is_complete(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) == 4  # the emoji is four byte tokens in both fixtures
    detok = IncrementalDetokenizer(tok, tok.encode("hi", add_special_tokens=False))
    assert [detok.add_tokens([i]) for i in ids] == ["", "", "", "😀"]


def test_unfinished_character_is_released_by_flush(tok):
    ids = tok.encode("a😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add_tokens(ids) == ""  # "a" waits together with the broken character
    rest = detok.flush()
    assert rest == tok.decode(ids) and rest.startswith("a") and rest.endswith("\ufffd")
    assert detok.flush() == ""


def test_adversarial_random_ids(tok):
    rng = random.Random(2)
    byte_ids = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert len(byte_ids) > 100  # byte-fallback / byte-level tokens exist in both fixtures
    specials = tok.all_special_ids
    for _ in range(40):
        pool = [rng.choice(byte_ids) for _ in range(6)] + [rng.randrange(tok.vocab_size)] + [rng.choice(specials)]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        # Prompts come from text, so they end on a character boundary (random byte ids there would join
        # with the output's bytes, which a decode of the output alone cannot show).
        prompt = tok.encode(rng.choice(TEXTS)[: rng.randint(0, 12)], add_special_tokens=False)
        for skip in (True, False):
            run(tok, prompt, ids, skip, rng)


def test_prompt_is_context_not_output(tok):
    prompt = tok.encode("some prompt text 你", add_special_tokens=False)
    ids = tok.encode(" and the answer 好", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.add_tokens([i]) for i in ids) + detok.flush() == " and the answer 好"


def test_work_per_step_is_bounded(tok):
    calls: list[int] = []
    decode = tok.decode

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return decode(ids, skip_special_tokens=skip_special_tokens)

    text = "今天天气很好，我们一起去公园散步吧。Hello world! " * 40
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(), list(range(50, 90)))
    for i in ids:
        detok.add_tokens([i])
    assert len(ids) > 400
    assert max(calls) <= 12  # a few context ids plus the held-back ones, never the whole output
    assert detok.text + detok.flush() == tok.decode(ids)
