"""No request can stop the engine through its sampling numbers (issue 41, point 2): non-finite or
out-of-range values, and bans that leave no token, are refused where the request is made, naming the
field (ValueError offline, HTTP 400 in OpenAI's error shape on the server); the values at the edges of
the allowed ranges sample fine, and the engine serves the next request."""
from __future__ import annotations

import json

import httpx
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.sampling_params import MAX_TEMPERATURE, MAX_TOP_K, REPETITION_PENALTY_RANGE

from test_api_server import KEY, TIMEOUT_S, Server

NAN, INF = float("nan"), float("inf")
GOOD = dict(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, max_model_len=64, block_size=16, max_num_seqs=4)


OFFLINE_BAD = [
    ("temperature", NAN), ("temperature", INF), ("temperature", 1e39), ("temperature", MAX_TEMPERATURE * 1.01),
    ("temperature", -1e-9),
    ("repetition_penalty", 1e-46), ("repetition_penalty", NAN), ("repetition_penalty", INF),
    ("repetition_penalty", 1e39), ("repetition_penalty", -1.0), ("repetition_penalty", 0.0),
    ("frequency_penalty", 1e39), ("frequency_penalty", NAN), ("frequency_penalty", -INF),
    ("presence_penalty", NAN), ("presence_penalty", 2.5),
    ("top_p", NAN), ("top_p", INF), ("top_p", -0.1), ("min_p", NAN), ("min_p", 1.01),
    ("top_k", 10**20), ("top_k", MAX_TOP_K + 1), ("seed", -1), ("logprobs", 10**20), ("prompt_logprobs", 10**20),
]


@pytest.mark.parametrize("name, value", OFFLINE_BAD, ids=[f"{n}={v!r}" for n, v in OFFLINE_BAD])
def test_out_of_range_sampling_values_are_refused(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("value", [NAN, INF, 1e39, 100.5])
def test_out_of_range_logit_bias_is_refused(value):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logits_processors_args={"logit_bias": {5: value}})


def test_refused_before_any_work_and_the_engine_goes_on(llm):
    """A bad value never reaches the engine: LLM.generate raises before queuing, nothing runs, and the
    next call is served."""
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=NAN, max_tokens=3), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    out = llm.generate([[5, 6, 7]], SamplingParams(**GOOD), use_tqdm=False)[0]
    assert out.error_code == 200 and len(out.outputs.token_ids) == 3


EDGES = [dict(temperature=MAX_TEMPERATURE), dict(temperature=1e-30), dict(repetition_penalty=REPETITION_PENALTY_RANGE[0]),
         dict(repetition_penalty=REPETITION_PENALTY_RANGE[1]), dict(frequency_penalty=2.0, presence_penalty=2.0),
         dict(frequency_penalty=-2.0, presence_penalty=-2.0), dict(top_p=1e-30), dict(min_p=1.0), dict(top_k=MAX_TOP_K),
         dict(logits_processors_args={"logit_bias": {5: 100.0, 6: -100.0}}),
         dict(temperature=MAX_TEMPERATURE, bad_words_token_ids=[5, 6], min_tokens=3)]


@pytest.mark.parametrize("edge", EDGES, ids=[json.dumps(e) for e in EDGES])
def test_values_at_the_edges_sample_fine(llm, edge):
    """What the bounds let through keeps every logit finite: sampled (and greedy) steps give tokens."""
    params = SamplingParams(**{**GOOD, **edge, "max_tokens": 4})
    out = llm.generate([[5, 6, 7, 5, 6]], params, use_tqdm=False)[0]
    assert out.error_code == 200 and len(out.outputs.token_ids) == 4
    assert not set(out.outputs.token_ids) & set(edge.get("bad_words_token_ids", ()))


def test_the_largest_logprobs_allowed_is_the_whole_vocabulary(tiny_hf):
    """With max_logprobs=-1 (no engine limit) a huge k overflowed the step's int64 arrays; the largest k
    SamplingParams allows gives the whole vocabulary."""
    model = LLM(model=tiny_hf, max_model_len=64, block_size=16, max_num_seqs=2, max_logprobs=-1)
    k = 2**31 - 1
    out = model.generate([[5, 6, 7]], SamplingParams(**GOOD, logprobs=k, prompt_logprobs=k), use_tqdm=False)[0]
    assert out.error_code == 200 and len(out.outputs.logprobs[0]) == model.engine.vocab_size


def ban_all_cases(vocab: int) -> list[dict]:
    everything = list(range(vocab))
    return [dict(bad_words_token_ids=everything), dict(temperature=0, bad_words_token_ids=everything),
            # Below min_tokens EOS (2) and the stop ids are banned too.
            dict(bad_words_token_ids=everything[3:], stop_token_ids=[0, 1], min_tokens=1)]


def test_bans_of_the_whole_vocabulary_fail_only_that_request(llm):
    vocab = llm.engine.vocab_size
    for bans in ban_all_cases(vocab):
        outputs = llm.generate([[5, 6], [7, 8]], [SamplingParams(**GOOD), SamplingParams(max_tokens=3, **bans)],
                               use_tqdm=False)
        assert [o.error_code for o in outputs] == [200, 400], bans
        assert "ban all" in outputs[1].error_msg and "bad_words_token_ids" in outputs[1].error_msg
        assert len(outputs[0].outputs.token_ids) == 3
    # One id left (EOS, free once min_tokens=0 is reached): allowed, and only it comes out.
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, min_tokens=0, ignore_eos=True,
                                                bad_words_token_ids=[t for t in range(vocab) if t != 2]),
                       use_tqdm=False)[0]
    assert out.error_code == 200 and out.outputs.token_ids == [2, 2]


# ---- the server: raw JSON text, so NaN, Infinity and 1e39 reach it as a client could send them ----

# (field, JSON text of its value) for both endpoints.
SERVER_BAD = [
    ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "1e39"), ("temperature", "1e400"),
    ("temperature", "-1"), ("repetition_penalty", "1e-46"), ("repetition_penalty", "NaN"),
    ("repetition_penalty", "1e39"), ("frequency_penalty", "1e39"), ("frequency_penalty", "NaN"),
    ("presence_penalty", "-Infinity"), ("top_p", "NaN"), ("top_p", "1.5"), ("min_p", "NaN"),
    ("top_k", "100000000000000000000"), ("seed", "-1"), ("logit_bias", '{"5": NaN}'), ("logit_bias", '{"5": 1e39}'),
]


@pytest.fixture(scope="module")
def server(tiny_hf):
    s = Server(tiny_hf, "--api-key", KEY, "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0


def post(server: Server, path: str, body: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", content=body, timeout=TIMEOUT_S,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


def body_with(path: str, extra: str) -> str:
    head = ('"messages": [{"role": "user", "content": "hi"}]' if path == "chat/completions"
            else '"prompt": "Once upon a time"')
    return '{"model": "tiny", %s, "max_tokens": 3%s}' % (head, extra)


def assert_openai_400(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert field in error["message"] and error.get("param") in (field, None), error


@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_server_refuses_each_bad_value_and_serves_the_next(server, path):
    for field, text in SERVER_BAD:
        assert_openai_400(post(server, path, body_with(path, f', "{field}": {text}')), field)
    for bans in ban_all_cases(1024):  # the tiny model's vocabulary
        extra = "".join(f', "{k}": {json.dumps(v)}' for k, v in bans.items())
        assert_openai_400(post(server, path, body_with(path, extra)), "bad_words_token_ids")
    r = post(server, path, body_with(path, ', "temperature": 0.7, "seed": 1'))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_server_names_the_field_of_a_parsed_value(server):
    """1e39 is a finite JSON number (the model accepts it), so SamplingParams names the field: param set."""
    r = post(server, "chat/completions", body_with("chat/completions", ', "temperature": 1e39'))
    assert_openai_400(r, "temperature")
    assert r.json()["error"]["param"] == "temperature"


def test_request_models_refuse_non_finite_floats_themselves():
    """Every float field of both request bodies (logit_bias values nested in a dict too) refuses NaN and
    inf before SamplingParams is built, as pydantic's own 400 naming the field."""
    from pydantic import ValidationError

    from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    for model, base in ((ChatCompletionRequest, {"messages": []}), (CompletionRequest, {"prompt": "x"})):
        floats = [n for n, f in model.model_fields.items() if "float" in str(f.annotation)]
        assert {"temperature", "top_p", "min_p", "logit_bias", "repetition_penalty"} <= set(floats)
        for name in floats:
            for bad in (NAN, INF, -INF):
                value = {"5": bad} if name == "logit_bias" else bad
                with pytest.raises(ValidationError, match=f"{name}[\\s\\S]*finite number"):
                    model.model_validate({**base, name: value})
