"""Reasoning parsers: the split of whole outputs, streamed splits that join to the same result,
and the engine path (reasoning_content, reasoning_max_tokens, enable_thinking)."""
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.reasoning.parsers import get_reasoning_parser

# (text, ernie-x1 split, ernie-45-vl / qwen3 split) — FastDeploy's documented behaviour.
CASES = [
    ("let me think\n</think>\n\n<response>\nHello!\n</response>",
     ("let me think", "Hello!"), ("let me think\n", "\n\n<response>\nHello!\n</response>")),
    ("plan</think>\n\nThe answer is 4.", ("plan", "The answer is 4."), ("plan", "\n\nThe answer is 4.")),
    ("still thinking, no end tag\n", ("still thinking, no end tag\n", ""), ("still thinking, no end tag\n", "")),
    ("t\n</think>\n<tool_call>{\"name\": \"f\"}</tool_call>", ("t", ""), ("t\n", "\n<tool_call>{\"name\": \"f\"}</tool_call>")),
    ("a</think><response>partial answer", ("a", "partial answer"), ("a", "<response>partial answer")),
    ("", ("", ""), ("", "")),
    ("x</think>", ("x", ""), ("x", "")),
    ("思考中…\n</think>\n\n<response>\n答案\n\n</response>", ("思考中…", "答案\n"), ("思考中…\n", "\n\n<response>\n答案\n\n</response>")),
]


@pytest.mark.parametrize("name, column", [("ernie-x1", 1), ("ernie-45-vl", 2), ("qwen3", 2)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_of_whole_output(name, column, case):
    text, expected = CASES[case][0], CASES[case][column]
    assert get_reasoning_parser(name).split(text, final=True) == expected


@pytest.mark.parametrize("name", ["ernie-x1", "ernie-45-vl", "qwen3"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_streamed_split_only_grows_and_joins_to_final(name, case):
    parser, text = get_reasoning_parser(name), CASES[case][0]
    sent_r = sent_c = ""
    for end in range(len(text) + 1):
        r, c = parser.split(text[:end], final=False)
        assert r.startswith(sent_r) and c.startswith(sent_c), (text[:end], r, c)
        sent_r, sent_c = r, c
    final = parser.split(text, final=True)
    assert final[0].startswith(sent_r) and final[1].startswith(sent_c)


def test_qwen3_drops_a_leading_think_tag():
    assert get_reasoning_parser("qwen3").split("<think>\nhm</think>ok", final=True) == ("\nhm", "ok")


def test_ernie_vl_status_comes_from_the_prompt():
    parser = get_reasoning_parser("ernie-45-vl")
    assert parser.starts_in_reasoning("User: hi\nAssistant: <think>\n", True)
    assert not parser.starts_in_reasoning("User: hi\nAssistant: <think>\n\n</think>\n\n", True)
    assert not parser.starts_in_reasoning("User: hi\nAssistant: ", True)


def test_unknown_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match="ernie-x1"):
        get_reasoning_parser("nope")


@pytest.fixture(scope="module")
def thinking_llm(tiny_hf):
    return LLM(model=tiny_hf, block_size=16, reasoning_parser="ernie-x1")


PROMPT = [17, 250, 33, 480, 91, 700, 12, 5]


def expected_split(llm, token_ids):
    text = llm.get_tokenizer().decode(token_ids)
    reasoning, _, rest = text.partition("</think>")
    return reasoning[:-1] if reasoning.endswith("\n") else reasoning, rest.lstrip("\n")


def test_reasoning_max_tokens_forces_the_end_of_thinking(thinking_llm):
    free = thinking_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                 use_tqdm=False)[0].outputs
    assert free.text == "" and "</think>" not in free.reasoning_content  # all thinking, never closed
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, reasoning_max_tokens=5)
    out = thinking_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    forced = thinking_llm.get_tokenizer().encode("\n</think>\n\n", add_special_tokens=False)
    assert out.token_ids[:5] == free.token_ids[:5]
    assert out.token_ids[5:5 + len(forced)] == forced
    assert (out.reasoning_content, out.text) == expected_split(thinking_llm, out.token_ids)
    assert out.text != ""


def test_reasoning_stream_joins_to_the_same_split(thinking_llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, reasoning_max_tokens=4)
    whole = thinking_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    reasoning = text = ""
    for chunk in thinking_llm.generate([PROMPT], params, use_tqdm=False, stream=True):
        reasoning += chunk[0].outputs.reasoning_content
        text += chunk[0].outputs.text
    assert (reasoning, text) == (whole.reasoning_content, whole.text)


def test_enable_thinking_false_leaves_everything_in_text(thinking_llm):
    conv = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = thinking_llm.chat(conv, params, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    assert out.outputs.reasoning_content == "" and out.outputs.text == thinking_llm.get_tokenizer().decode(
        out.outputs.token_ids)
    with pytest.raises(ValueError, match="reasoning_max_tokens"):
        LLM(model=thinking_llm.config.model, block_size=16).generate(
            [PROMPT], SamplingParams(max_tokens=8, reasoning_max_tokens=4), use_tqdm=False)
