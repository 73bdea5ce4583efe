"""FastDeploy's public names beyond LLM/SamplingParams: import paths, SamplingParams' extra fields and
constructors, best_of, the logprob transforms, and the ernie-45-vl-thinking / deepseek reasoning parsers.
The expected names, orders and fallbacks are FastDeploy 2.x's (engine/sampling_params.py, worker/output.py,
engine/request.py, reasoning/*.py)."""
import dataclasses
from importlib import metadata

import numpy as np
import paddle
import pytest
from test_logprobs_n_stream import full_logits, log_softmax

import fastdeploy
from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.request import RequestMetrics, RequestType, Request
from fastdeploy.engine.sampling_params import GuidedDecodingParams, RequestOutputKind
from fastdeploy.reasoning.parsers import get_reasoning_parser

PROMPT = [17, 250, 33, 480, 91, 700, 12, 5]

# FastDeploy's SamplingParams fields, in its declaration order.
FASTDEPLOY_FIELDS = [
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "stop_seqs_len", "max_tokens", "reasoning_max_tokens",
    "min_tokens", "logprobs", "prompt_logprobs", "temp_scaled_logprobs", "top_p_normalized_logprobs",
    "bad_words", "guided_decoding", "bad_words_token_ids", "logits_processors_args"]


# ---- import paths ----------------------------------------------------------------------------
def test_model_registry_lists_and_resolves_architectures():
    from fastdeploy.model_executor.models.qwen3 import Qwen3ForCausalLM
    registry = fastdeploy.ModelRegistry
    archs = registry.get_supported_archs()
    assert {"Ernie4_5_ForCausalLM", "Ernie4_5_MoeForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(archs)
    assert registry.resolve_model_cls(["GPTNeoXForCausalLM", "Qwen3ForCausalLM"]) == (Qwen3ForCausalLM,
                                                                                        "Qwen3ForCausalLM")
    assert registry.get_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert registry.is_multimodal_model("Ernie4_5_VLMoeForConditionalGeneration")
    assert not registry.is_multimodal_model(["Qwen3ForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture"):
        registry.get_class("GPTNeoXForCausalLM")


def test_version_reports_the_installed_package_and_paddle():
    installed = metadata.version("fastdeploy-cpu")
    assert fastdeploy.__version__ == installed
    text = fastdeploy.version()
    assert f"fastdeploy version: {installed}\n" in text and f"Paddle version: {paddle.__version__}" in text


def test_logprob_is_one_named_tuple_everywhere():
    from fastdeploy.engine.request import Logprob as from_request
    from fastdeploy.worker.output import Logprob
    assert from_request is Logprob and fastdeploy.Logprob is Logprob
    assert issubclass(Logprob, tuple) and Logprob._fields == ("logprob", "rank", "decoded_token")
    entry = Logprob(-0.5)
    assert entry == (-0.5, None, None) and entry.logprob == -0.5
    with pytest.raises(AttributeError):
        entry.rank = 1


def test_request_output_kind_and_request_type():
    assert [(k.name, k.value) for k in RequestOutputKind] == [("CUMULATIVE", 0), ("DELTA", 1), ("FINAL_ONLY", 2)]
    assert [(k.name, k.value) for k in RequestType] == [("PREFILL", 0), ("DECODE", 1), ("PREEMPTED", 2),
                                                        ("EXTEND", 3)]
    request = Request(request_id="r", prompt_token_ids=[1, 2, 3], params=SamplingParams(), max_tokens=4,
                      eos_token_ids=frozenset(), generator=np.random.default_rng(0),
                      metrics=RequestMetrics(arrival_time=0.0))
    assert request.task_type is RequestType.PREFILL
    request.num_computed_tokens = 3
    assert request.task_type is RequestType.DECODE


# ---- SamplingParams ----------------------------------------------------------------------------
def test_fields_keep_fastdeploys_order_for_positional_use():
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert names[:len(FASTDEPLOY_FIELDS)] == FASTDEPLOY_FIELDS
    params = SamplingParams(2, 3, 0.5, 0.25, 1.1, 0.7, 0.9, 5)
    assert (params.n, params.best_of, params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.temperature, params.top_p, params.top_k) == (2, 3, 0.5, 0.25, 1.1, 0.7, 0.9, 5)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"n": 3, "best_of": 2}, ValueError, "best_of must be an int >= n"),
    ({"best_of": 2.0}, TypeError, "best_of must be an int"),
    ({"stop_seqs_len": 3}, NotImplementedError, "stop_seqs_len"),
    ({"temp_scaled_logprobs": 1}, TypeError, "temp_scaled_logprobs must be a bool"),
    ({"top_p_normalized_logprobs": "yes"}, TypeError, "top_p_normalized_logprobs must be a bool"),
])
def test_bad_new_fields_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_from_dict_round_trips_and_refuses_unknown_keys():
    params = SamplingParams(n=2, best_of=3, temperature=0.5, top_k=4, stop=["x"], max_tokens=9,
                            temp_scaled_logprobs=True, guided_decoding=GuidedDecodingParams(regex="a+"),
                            logits_processors_args={"logit_bias": {3: 1.5}})
    assert SamplingParams.from_dict(dataclasses.asdict(params)) == params
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict({"top_p": 0.3}) == SamplingParams(top_p=0.3)
    with pytest.raises(ValueError, match="prompt"):
        SamplingParams.from_dict({"prompt": "hi", "top_p": 0.3})


def test_from_optional_fills_fastdeploys_fallbacks():
    params = SamplingParams.from_optional(None, None, None, None, None, None, None, None, None)
    assert (params.n, params.best_of, params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens) == (
        1, None, 0.0, 0.0, 1.0, 1.0, None, 0, 0.0, 8192)
    given = SamplingParams.from_optional(2, 4, 0.1, 0.2, 1.2, 0.3, 0.8, 7, 0.05, 11, ["z"], [5], 30, None, 2, 3)
    assert given == SamplingParams(n=2, best_of=4, presence_penalty=0.1, frequency_penalty=0.2,
                                   repetition_penalty=1.2, temperature=0.3, top_p=0.8, top_k=7, min_p=0.05, seed=11,
                                   stop=["z"], stop_token_ids=[5], max_tokens=30, min_tokens=2, logprobs=3)


# ---- best_of and logprob transforms on the tiny model ----------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, block_size=16, max_num_seqs=8, max_logprobs=-1)


def cumulative(output):
    return sum(entry[token].logprob for token, entry in zip(output.token_ids, output.logprobs))


def test_best_of_returns_the_n_best_candidates_by_cumulative_logprob(llm):
    common = dict(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    every = llm.generate([PROMPT], SamplingParams(n=5, logprobs=0, **common), use_tqdm=False)
    candidates = [(cumulative(o.outputs), o.outputs.token_ids) for o in every]
    assert len({tuple(ids) for _, ids in candidates}) > 2  # distinct candidates, so the choice matters
    ranked = sorted(candidates, key=lambda c: c[0], reverse=True)

    best = llm.generate([PROMPT, [9, 8, 7]], SamplingParams(n=2, best_of=5, **common), use_tqdm=False)
    assert len(best) == 4 and [o.outputs.index for o in best] == [0, 1, 2, 3]
    assert [o.outputs.token_ids for o in best[:2]] == [ids for _, ids in ranked[:2]]
    assert best[0].outputs.logprobs is None  # ranking alone asks for no logprobs in the output

    with_logprobs = llm.generate([PROMPT], SamplingParams(n=1, best_of=5, logprobs=2, **common), use_tqdm=False)
    assert with_logprobs[0].outputs.token_ids == ranked[0][1]
    assert cumulative(with_logprobs[0].outputs) == pytest.approx(ranked[0][0], abs=1e-4)
    with pytest.raises(ValueError, match="best_of"):
        llm.generate([PROMPT], SamplingParams(n=1, best_of=2), use_tqdm=False, stream=True)


def nucleus(logp, top_p):
    """Log-probabilities cut to the top_p nucleus and renormalised (outside: float32 min)."""
    order = np.argsort(-logp, kind="stable")
    probs = np.exp(logp[order])
    keep = order[np.cumsum(probs) - probs <= top_p]
    out = np.full_like(logp, np.finfo(np.float32).min)
    out[keep] = logp[keep] - np.log(np.exp(logp[keep]).sum())
    return out


@pytest.mark.parametrize("scaled, normalized", [(True, False), (False, True), (True, True)])
def test_temp_scaled_and_top_p_normalized_logprobs(llm, scaled, normalized):
    common = dict(temperature=0.7, top_p=0.6, seed=5, max_tokens=4, ignore_eos=True, logprobs=-1)
    raw = llm.generate([PROMPT], SamplingParams(**common), use_tqdm=False)[0].outputs
    out = llm.generate([PROMPT], SamplingParams(temp_scaled_logprobs=scaled, top_p_normalized_logprobs=normalized,
                                                **common), use_tqdm=False)[0].outputs
    assert out.token_ids == raw.token_ids  # the transforms change the reported logprobs, not the sampling
    logits = full_logits(llm, PROMPT + out.token_ids)[len(PROMPT) - 1:-1]
    for step, entry in enumerate(out.logprobs):
        expected = log_softmax(logits[step] / (0.7 if scaled else 1.0))
        if normalized:
            expected = nucleus(expected, 0.6)
        got = np.array([entry[t].logprob for t in range(len(expected))])
        assert np.allclose(got, expected, atol=1e-3)
        if normalized:
            assert (got > np.finfo(np.float32).min).sum() < len(got)  # the nucleus left tokens out


# ---- reasoning parsers -----------------------------------------------------------------------------
# (text as the model writes it, expected (reasoning, content)).
VL_THINKING = [
    ("The picture shows a cat.\n</think>\n\nA cat on a sofa.", ("The picture shows a cat.\n", "A cat on a sofa.")),
    ("still looking at the image", ("still looking at the image", "")),
    ("need the tool\n</think>\n\n<tool_call>\n{\"name\": \"zoom\"}\n</tool_call>", ("need the tool\n", "")),
    ("ok</think>Sure. <tool_call>{}</tool_call>", ("ok", "Sure. <tool_call>{}</tool_call>")),
    ("x</think>", ("x", "")),
    ("", ("", "")),
]
DEEPSEEK = [
    ("Add them: 2 + 2.\n</think>\n\nThe answer is 4.\n", ("Add them: 2 + 2.", "The answer is 4.")),
    ("<think>\nhmm, 2 + 2\n</think>\n\n4", ("\nhmm, 2 + 2\n", "4")),
    ("<think>never closed", ("never closed", "")),
    ("  thinking with no end tag  ", ("thinking with no end tag", "")),
    ("x</think>", ("x", "")),
    ("", ("", "")),
]
PARSER_CASES = [("ernie-45-vl-thinking", *c) for c in VL_THINKING] + [
    (name, *c) for name in ("deepseek", "deepseek-r1") for c in DEEPSEEK]


@pytest.mark.parametrize("name, text, expected", PARSER_CASES)
def test_split_of_recorded_outputs(name, text, expected):
    assert get_reasoning_parser(name).split(text, final=True) == expected


@pytest.mark.parametrize("name, text, expected", PARSER_CASES)
def test_streamed_deltas_join_to_the_whole_split(name, text, expected):
    parser = get_reasoning_parser(name)
    sent_r = sent_c = ""
    for end in range(len(text) + 1):  # one character per delta: the hardest chunking
        r, c = parser.split(text[:end], final=False)
        assert r.startswith(sent_r) and c.startswith(sent_c), (text[:end], r, c)
        sent_r, sent_c = r, c
    final = parser.split(text, final=True)
    assert final[0].startswith(sent_r) and final[1].startswith(sent_c)
    assert final == expected


def test_vl_thinking_keeps_tool_calls_for_a_tool_parser_and_reads_the_prompt():
    parser = get_reasoning_parser("ernie-45-vl-thinking")
    text = "need the tool\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    assert parser.split(text, final=True, keep_tool_calls=True) == ("need the tool\n", "<tool_call>\n{}\n</tool_call>")
    assert parser.starts_in_reasoning("User: hi\nAssistant: <think>\n", False)
    assert not parser.starts_in_reasoning("User: hi\nAssistant: <think>\n\n</think>\n\n", True)
    assert parser.starts_in_reasoning("User: hi\nAssistant: ", True)
    assert not parser.starts_in_reasoning("User: hi\nAssistant: ", False)


def test_deepseek_applies_only_when_the_prompt_opens_thinking():
    parser = get_reasoning_parser("deepseek-r1")
    assert parser.starts_in_reasoning("<｜User｜>hi<｜Assistant｜><think>\n", True)
    assert not parser.starts_in_reasoning("<｜User｜>hi<｜Assistant｜>", True)
    assert not parser.starts_in_reasoning("<｜User｜>hi<｜Assistant｜><think>\n\n</think>\n\n", True)


@pytest.mark.parametrize("parser", ["ernie-45-vl-thinking", "deepseek"])
def test_engine_stream_joins_to_the_final_split(tiny_hf, parser):
    llm = LLM(model=tiny_hf, block_size=16, max_num_seqs=4, reasoning_parser=parser)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "User: hi\nAssistant: <think>\n"  # opens the thinking part, so both parsers apply
    result = llm.generate([prompt], params, use_tqdm=False)[0]
    final = result.outputs
    assert get_reasoning_parser(parser).starts_in_reasoning(result.prompt, True)
    reasoning = text = ""
    for chunk in llm.generate([prompt], params, use_tqdm=False, stream=True):
        if chunk[0] is not None:
            reasoning += chunk[0].outputs.reasoning_content or ""
            text += chunk[0].outputs.text or ""
    assert (reasoning, text) == (final.reasoning_content, final.text)
    whole = llm.get_tokenizer().decode(final.token_ids, skip_special_tokens=True)
    assert (final.reasoning_content, final.text) == get_reasoning_parser(parser).split(whole, final=True)
