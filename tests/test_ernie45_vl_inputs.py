"""ERNIE-4.5-VL inputs that work today, against transformers' records for the tiny VL fixture
(tools/make_ernie45_vl_fixture.py): the chat template with image and video parts, and the refusal of the
model itself until it is supported."""
import json
from pathlib import Path

import pytest

from fastdeploy import LLM
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


def test_the_vl_model_is_refused_clearly_until_supported():
    with pytest.raises(NotImplementedError, match="multimodal"):
        LLM(model=str(VL))
