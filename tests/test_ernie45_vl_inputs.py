"""ERNIE-4.5-VL inputs that work today, against transformers' records for the tiny VL fixture
(tools/make_ernie45_vl_fixture.py): the chat template with image and video parts, and what LLM does with
a VL checkpoint until the engine passes images (text prompts exactly, media parts refused)."""
import json
from pathlib import Path

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.input.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VL = FIXTURES / "models" / "ernie45_vl_tiny_hf"
REF = json.loads((FIXTURES / "reference" / "ernie45_vl_tiny.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(VL)


@pytest.mark.parametrize("case", REF["cases"] + REF["chat_template_cases"],
                         ids=lambda c: c.get("name") or str(c.get("kwargs")))
def test_chat_template_renders_as_the_reference(tokenizer, case):
    kwargs = case.get("chat_template_kwargs", case.get("kwargs")) or {}
    kwargs = {"add_generation_prompt": True, **kwargs}
    assert tokenizer.apply_chat_template(case["messages"], **kwargs) == case["prompt"]


def test_text_only_prompt_tokenizes_as_the_reference(tokenizer):
    case = next(c for c in REF["cases"] if c["name"] == "text_only")
    assert tokenizer.encode(case["prompt"], add_special_tokens=False) == case["input_ids"]


def test_llm_serves_text_prompts_on_one_position_row_and_names_unreadable_media():
    """A step without media passes one position row and no token types: exact for text-only prompts
    (rope_delta 0, every token text). Media go through tests/test_ernie45_vl_generate.py; an unreadable
    image source fails its request with a message naming it."""
    case = next(c for c in REF["cases"] if c["name"] == "text_only")
    llm = LLM(model=str(VL))
    params = SamplingParams(temperature=0, max_tokens=len(case["output_token_ids"]), ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": case["input_ids"]}], params, use_tqdm=False)
    assert out[0].outputs.token_ids == case["output_token_ids"]
    image = next(c for c in REF["cases"] if c["name"] == "one_image")
    out = llm.chat(image["messages"], params, use_tqdm=False)[0]
    assert out.error_code == 400 and "synthetic" in out.error_msg
