"""Structured outputs through the OpenAI server and the official `openai` client: response_format
(json_schema, json_object) and FastDeploy's guided_* extras, streamed and not, each output checked by an
independent validator and equal to LLM.generate/LLM.chat with the same GuidedDecodingParams; bad specs
are HTTP 400 naming the field."""
import json
import re

import httpx
import jsonschema
import openai
import pytest
from test_api_server import KEY, MAX_MODEL_LEN, TIMEOUT_S, Server
from test_structured_outputs import CHOICES, EBNF, REGEX, SCHEMA, evaluate

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.sampling_params import GuidedDecodingParams

MESSAGES = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(tiny_hf):
    s = Server(tiny_hf, "--api-key", KEY, "--served-model-name", "tiny", "--guided-decoding-disable-any-whitespace")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, max_model_len=MAX_MODEL_LEN, guided_decoding_disable_any_whitespace=True)


def chat(server, **kw):
    kw = {"temperature": 1.0, "seed": 3, "max_tokens": 120, **kw}
    return server.client().chat.completions.create(model="tiny", messages=MESSAGES, **kw)


def test_response_format_json_schema_equals_llm_chat(server, llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    response = chat(server, response_format=fmt, n=4)
    expected = llm.chat(MESSAGES, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120,
                                                 guided_decoding=GuidedDecodingParams(json=SCHEMA)), use_tqdm=False)
    assert [c.message.content for c in response.choices] == [o.outputs.text for o in expected]
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_object_joins_to_valid_json(server):
    stream = chat(server, response_format={"type": "json_object"}, stream=True, seed=1, max_tokens=200,
                  extra_body={"top_k": 5})
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    assert isinstance(json.loads("".join(parts)), dict)


@pytest.mark.parametrize("extra, validate", [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or 1 / 0),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES or 1 / 0),
    ({"guided_grammar": EBNF}, evaluate),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
])
def test_guided_extras_on_both_endpoints(server, extra, validate):
    response = chat(server, n=2, extra_body=extra)
    completion = server.client().completions.create(model="tiny", prompt="Answer:", temperature=1.0, seed=5, n=2,
                                                    max_tokens=120, extra_body=extra)
    texts = [c.message.content for c in response.choices] + [c.text for c in completion.choices]
    assert [c.finish_reason for c in response.choices + completion.choices] == ["stop"] * 4
    for text in texts:
        validate(text)


def test_logprobs_of_disallowed_tokens_are_json_numbers(server):
    """A grammar leaves most tokens at logprob -inf, which JSON cannot carry: they come as -9999.0 (as
    vLLM's server sends them), in the chat and the completions form."""
    response = chat(server, logprobs=True, top_logprobs=20, max_tokens=8, extra_body={"guided_choice": CHOICES})
    assert response.choices[0].message.content in CHOICES
    chat_values = [top.logprob for item in response.choices[0].logprobs.content for top in item.top_logprobs]
    completion = server.client().completions.create(model="tiny", prompt="Answer:", temperature=0, max_tokens=8,
                                                    logprobs=5, extra_body={"guided_choice": CHOICES})
    completion_values = [v for top in completion.choices[0].logprobs.top_logprobs for v in top.values()]
    for values in (chat_values, completion_values):
        assert min(values) == -9999.0 and max(values) <= 0.0


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_specs_are_400_naming_the_field(server, body, field):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
    assert r.status_code == 400
    error = r.json()["error"]
    assert field in error["message"] and error["code"] == 400
    assert "Traceback" not in r.text
    with pytest.raises(openai.BadRequestError, match=field):
        server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=body)
