"""Guided decoding offline: GuidedDecodingParams' validation, every sampled output (temperature 1, n=4,
streamed and not) checked by an independent validator (jsonschema, re.fullmatch, membership, a Lark parser
and evaluator), unconstrained neighbours unchanged, preemption, reasoning, and the mask op against
llguidance's own numpy reference."""
import json
import re
from pathlib import Path

import jsonschema
import lark
import llguidance.numpy as ll_numpy
import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.config import EngineConfig
from fastdeploy.engine.sampling_params import GuidedDecodingParams
from fastdeploy.guided.matcher import GuidedDecoding
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.ops.token_bitmask import apply_token_bitmask_

DEMO = Path(__file__).resolve().parent.parent / "models" / "ernie-4.5-demo"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}}}
REGEX = r"[a-z]{2,5}-[0-9]{2,4}"
CHOICES = ["yes", "no", "maybe not"]
# Arithmetic in FastDeploy's EBNF (GBNF, as xgrammar and llama.cpp write it) and the same language in Lark.
EBNF = r'''root ::= expr
expr ::= term (op term){0,3}
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [0-9]{1,3}'''
LARK = r'''start: term (OP term)~0..3
?term: NUM | "(" NUM OP NUM ")"
OP: "+" | "-" | "*"
NUM: /[0-9]{1,3}/'''
PROMPTS = ["Hello", "Tell me about files", "1 + 2 ="]


def evaluate(text: str) -> int:
    """The expression's value by an independent parser (Lark), left to right with * first, as Python."""
    tree = lark.Lark(LARK, parser="earley").parse(text)
    flat = []
    for item in tree.children:
        if isinstance(item, lark.Tree):  # a parenthesised term
            a, op, b = (str(c) for c in item.children)
            flat.append(f"({int(a)}{op}{int(b)})")
        elif item.type == "NUM":
            flat.append(str(int(item)))
        else:
            flat.append(str(item))
    return eval("".join(flat))  # only digits, parentheses and + - * reach here


SPECS = {
    "json": (GuidedDecodingParams(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "json_object": (GuidedDecodingParams(json_object=True), lambda t: isinstance(json.loads(t), dict) or 1 / 0),
    "regex": (GuidedDecodingParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) or 1 / 0),
    "choice": (GuidedDecodingParams(choice=CHOICES), lambda t: t in CHOICES or 1 / 0),
    "grammar": (GuidedDecodingParams(grammar=EBNF), evaluate),
}


@pytest.fixture(scope="module")
def llm(tiny_hf):
    # Without optional whitespace a tiny random model always finishes a bounded schema within max_tokens.
    return LLM(model=tiny_hf, max_model_len=256, max_num_seqs=16, guided_decoding_disable_any_whitespace=True)


def check_all(outputs, validate) -> None:
    for out in outputs:
        assert out.error_code == 200, out.error_msg
        assert out.outputs.finish_reason == "stop", (out.outputs.text, out.outputs.finish_reason)
        validate(out.outputs.text)


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_sampled_output_obeys_its_constraint(llm, kind):
    spec, validate = SPECS[kind]
    # Any JSON object has unbounded keys and strings: top_k keeps the tiny random model's objects short.
    extra = {"top_k": 5, "top_p": 1.0, "seed": 1, "max_tokens": 240} if kind == "json_object" else {}
    params = SamplingParams(**{"n": 4, "temperature": 1.0, "top_p": 0.95, "seed": 7, "max_tokens": 120,
                               "guided_decoding": spec, **extra})
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outputs) == 4 * len(PROMPTS)
    check_all(outputs, validate)
    assert len({o.outputs.text for o in outputs}) > 1  # really sampled


def test_streamed_outputs_join_to_the_same_constrained_text(llm):
    spec, validate = SPECS["json"]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=120, guided_decoding=spec,
                            repetition_penalty=1.2, top_k=50, min_p=0.01)
    whole = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    texts = [""] * len(whole)
    finish = [None] * len(whole)
    for chunk in llm.generate(PROMPTS[:2], params, use_tqdm=False, stream=True):
        for i, out in enumerate(chunk):
            if out is not None:
                texts[i] += out.outputs.text
                finish[i] = out.outputs.finish_reason or finish[i]
    assert texts == [o.outputs.text for o in whole]
    assert finish == ["stop"] * len(whole)
    check_all(whole, validate)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm, temperature):
    plain = SamplingParams(temperature=temperature, seed=5, max_tokens=24)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    constrained = [SamplingParams(temperature=1.0, seed=9, max_tokens=60, guided_decoding=SPECS[k][0])
                   for k in ("json", "regex", "grammar")]
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + constrained, use_tqdm=False)
    assert [o.outputs.token_ids for o in mixed[:3]] == [o.outputs.token_ids for o in alone]
    for out, kind in zip(mixed[3:], ("json", "regex", "grammar")):
        check_all([out], SPECS[kind][1])


def test_preempted_constrained_requests_resume_their_grammar(tiny_hf, llm):
    # 6 blocks of 16 tokens for 8 requests: the scheduler preempts and recomputes while they decode.
    small = LLM(model=tiny_hf, max_model_len=256, max_num_seqs=8, block_size=16, num_gpu_blocks_override=16,
                guided_decoding_disable_any_whitespace=True)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120, guided_decoding=SPECS["json"][0])
    prompts = ["word " * 30, "other words " * 12]
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    check_all(outputs, SPECS["json"][1])
    reference = llm.generate(prompts, params, use_tqdm=False)  # seeded: the same tokens without preemption
    assert [o.outputs.token_ids for o in outputs] == [o.outputs.token_ids for o in reference]


def test_grammar_end_finishes_even_when_eos_is_ignored(llm):
    params = SamplingParams(temperature=1.0, seed=1, ignore_eos=True, max_tokens=50,
                            guided_decoding=GuidedDecodingParams(choice=["alpha", "beta"]))
    out, = llm.generate(["Pick one:"], params, use_tqdm=False)
    assert out.outputs.text in ("alpha", "beta") and out.outputs.finish_reason == "stop"


def test_constraint_applies_after_the_thinking_part(tiny_hf):
    llm = LLM(model=tiny_hf, max_model_len=256, reasoning_parser="ernie-x1")
    params = SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=60, reasoning_max_tokens=6,
                            guided_decoding=GuidedDecodingParams(choice=CHOICES))
    outputs = llm.chat([{"role": "user", "content": "Answer yes or no."}], params, use_tqdm=False)
    for out in outputs:
        assert out.outputs.reasoning_content  # thinking was free text
        assert out.outputs.text.strip() in CHOICES, out.outputs.text
        assert out.outputs.finish_reason == "stop"


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"json": SCHEMA, "regex": "a"}, "exactly one of"),
    ({"json": {"type": "objectx"}}, "guided_decoding.json is not valid"),
    ({"json": "{not json"}, "guided_decoding.json is not valid JSON"),
    ({"regex": "(ab"}, "guided_decoding.regex is not valid"),
    ({"choice": []}, "guided_decoding.choice must be a non-empty list"),
    ({"grammar": "root ::= ("}, "guided_decoding.grammar is not a valid grammar"),
    ({"grammar": "start: undefined_rule"}, "guided_decoding.grammar is not valid"),
    ({"json_object": False}, "json_object must be True"),
    ({"structural_tag": {"structures": [], "triggers": []}}, "structural_tag must be"),
])
def test_bad_specs_are_value_errors_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GuidedDecodingParams(**kwargs)


def test_names_and_types(tiny_hf):
    assert GuidedDecodingParams(regex="a+").to_dict() == {"guided_regex": "a+"}
    with pytest.raises(TypeError, match="guided_decoding must be a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"json": SCHEMA})
    for backend in ("xgrammar", "outlines"):
        with pytest.raises(ValueError, match=r"guided_decoding_backend must be one of \['auto', 'llguidance'"):
            EngineConfig(model=tiny_hf, guided_decoding_backend=backend)
    assert EngineConfig(model=tiny_hf, guided_decoding_backend="llguidance").guided_decoding_backend == "llguidance"


def test_backend_off_fails_only_the_constrained_request(tiny_hf):
    llm = LLM(model=tiny_hf, max_model_len=128, guided_decoding_backend="off")
    outputs = llm.generate(["a", "b"], [SamplingParams(max_tokens=4, guided_decoding=SPECS["regex"][0]),
                                        SamplingParams(max_tokens=4)], use_tqdm=False)
    assert outputs[0].error_code == 400 and "guided_decoding_backend='off'" in outputs[0].error_msg
    assert outputs[1].error_code == 200 and len(outputs[1].outputs.token_ids) == 4


def test_structural_tag_constrains_only_the_tagged_segments(tiny_hf):
    tokenizer = Tokenizer.from_pretrained(tiny_hf)
    guided = GuidedDecoding(tokenizer, 1024, [tokenizer.eos_token_id], "auto")
    tag = {"structures": [{"begin": "<f=add>", "schema": {"type": "object", "required": ["a"],
                                                          "properties": {"a": {"type": "integer"}}},
                           "end": "</f>"}], "triggers": ["<f="]}
    spec = GuidedDecodingParams(structural_tag=tag)

    def accepts(text: str) -> bool:
        state = guided.new_state(spec, after_reasoning=False)
        return state.sync(tokenizer.encode(text, add_special_tokens=False))

    assert accepts('some text <f=add>{"a": 3}</f> more')
    assert accepts("plain text only")
    assert not accepts('text <f=add>{"a": "x"}</f>')
    assert not accepts("text <f=sub>")


def test_compiled_once_per_distinct_spec(llm):
    guided = llm.engine.structured_output.guided
    before = len(guided.compile_seconds)
    spec = GuidedDecodingParams(regex="[0-9]{3}x")
    llm.generate(["a", "b"], SamplingParams(n=2, max_tokens=8, guided_decoding=spec), use_tqdm=False)
    llm.generate(["c"], SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(regex="[0-9]{3}x")),
                 use_tqdm=False)
    assert len(guided.compile_seconds) == before + 1


def test_mask_op_matches_llguidance_reference_and_leaves_other_rows():
    rng = np.random.default_rng(0)
    vocab = 1000
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, size=(2, (vocab + 31) // 32)).astype(np.int32)
    rows = np.array([3, 1])
    expected = logits.copy()
    sub = expected[rows]
    ll_numpy.apply_token_bitmask_inplace(sub, mask)
    expected[rows] = sub
    apply_token_bitmask_(logits, rows, mask)
    assert np.array_equal(logits, expected)


def test_demo_model_outputs_obey_json_and_regex():
    llm = LLM(model=str(DEMO), max_model_len=256)  # compact JSON by default, as FastDeploy's engine
    for kind in ("json", "regex"):
        spec, validate = SPECS[kind]
        outputs = llm.chat([{"role": "user", "content": "Describe a person as JSON."}],
                           SamplingParams(n=4, temperature=1.0, seed=4, max_tokens=120, guided_decoding=spec),
                           use_tqdm=False)
        check_all(outputs, validate)
        if kind == "json":  # no optional whitespace: each record is its own compact dump
            for out in outputs:
                record = json.loads(out.outputs.text)
                assert out.outputs.text == json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def test_sync_rolls_back_and_replays_to_the_request_tokens(tiny_hf):
    tokenizer = Tokenizer.from_pretrained(tiny_hf)
    guided = GuidedDecoding(tokenizer, 1024, [tokenizer.eos_token_id], "auto")
    spec = GuidedDecodingParams(json=SCHEMA)
    ids = tokenizer.encode('{"name":"ab","age":7', add_special_tokens=False)

    def mask_after(tokens):
        state = guided.new_state(spec, after_reasoning=False)
        assert state.sync(tokens)
        bitmask, handle = guided.start_masks([state], [[]])
        handle.wait()
        return bitmask

    state = guided.new_state(spec, after_reasoning=False)
    assert state.sync(ids) and state.consumed == len(ids)
    assert state.sync(ids[:3]) and state.consumed == 3  # e.g. tokens taken back: the matcher rolls back
    bitmask, handle = guided.start_masks([state], [[]])
    handle.wait()
    assert np.array_equal(bitmask, mask_after(ids[:3]))
    assert not np.array_equal(bitmask, mask_after(ids))


def test_bans_that_leave_no_allowed_token_fail_only_that_request(llm):
    outputs = llm.generate(["a", "b"], [
        SamplingParams(temperature=1.0, max_tokens=10, bad_words=["yes"], guided_decoding=GuidedDecodingParams(
            choice=["yes"])),
        SamplingParams(max_tokens=5)], use_tqdm=False)
    assert outputs[0].error_code == 400 and "bans" in outputs[0].error_msg
    assert outputs[1].error_code == 200 and len(outputs[1].outputs.token_ids) == 5


@pytest.mark.parametrize("kind", ["json", "grammar"])
def test_a_tokenizer_json_model_obeys_constraints_too(kind):
    qwen = Path(__file__).resolve().parent / "fixtures" / "models" / "qwen2_tiny"  # tokenizer.json, byte-level BPE
    llm = LLM(model=str(qwen), max_model_len=256, guided_decoding_disable_any_whitespace=True)
    spec, validate = SPECS[kind]
    outputs = llm.generate(PROMPTS[:2], SamplingParams(n=4, temperature=1.0, seed=6, max_tokens=120,
                                                       guided_decoding=spec), use_tqdm=False)
    check_all(outputs, validate)


def test_logprobs_of_disallowed_tokens_are_minus_inf(tiny_hf):
    """The whole vocabulary's logprobs under a grammar: the allowed tokens share all the mass, each
    disallowed one is exactly -inf (never a floor such as -64)."""
    llm = LLM(model=tiny_hf, max_model_len=256, max_logprobs=-1)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=-1,
                            guided_decoding=GuidedDecodingParams(choice=CHOICES))
    out = llm.generate(["Pick one:"], params, use_tqdm=False)[0]
    assert out.outputs.text in CHOICES
    for token, entry in zip(out.outputs.token_ids, out.outputs.logprobs):
        values = np.array([lp.logprob for lp in entry.values()])
        allowed = np.isfinite(values)
        assert np.isneginf(values[~allowed]).any() and allowed.any()
        assert np.exp(values[allowed].astype(np.float64)).sum() == pytest.approx(1.0, abs=1e-4)
        assert np.isfinite(entry[token].logprob)
