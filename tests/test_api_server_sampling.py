"""FastDeploy's extra sampling fields through the OpenAI server (issue 16): `best_of` on completions (the
request that carries it in OpenAI's and FastDeploy's protocol), `temp_scaled_logprobs` and
`top_p_normalized_logprobs` on both endpoints. Sent with the official `openai` client, checked against
LLM.generate / LLM.chat with the same SamplingParams in this process; bad values get OpenAI's 400 naming them."""
import dataclasses

import openai
import pytest

from fastdeploy import LLM, SamplingParams

from test_api_server import KEY, MAX_MODEL_LEN, MESSAGES, Server

PROMPTS = ["Once upon a time", "The quick brown fox"]


@pytest.fixture(scope="module")
def server(tiny_hf):
    s = Server(tiny_hf, "--api-key", KEY, "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, max_model_len=MAX_MODEL_LEN)


def cumulative(output) -> float:
    return sum(entry[token].logprob for token, entry in zip(output.token_ids, output.logprobs))


def test_best_of_returns_what_llm_generate_returns(server, llm):
    common = dict(temperature=1.0, seed=11, max_tokens=8)
    ref = llm.generate(PROMPTS, SamplingParams(n=2, best_of=4, ignore_eos=True, **common), use_tqdm=False)
    # The four candidates of each prompt (sample j of n=4 is candidate j): the ranking must matter.
    every = llm.generate(PROMPTS, SamplingParams(n=4, ignore_eos=True, logprobs=0, **common), use_tqdm=False)
    for p in range(2):
        candidates = every[4 * p:4 * p + 4]
        best = sorted(candidates, key=lambda o: cumulative(o.outputs), reverse=True)[:2]
        assert [o.outputs.token_ids for o in ref[2 * p:2 * p + 2]] == [o.outputs.token_ids for o in best]
    assert [o.outputs.token_ids for o in ref] != [o.outputs.token_ids for o in every[:2] + every[4:6]]

    r = server.client().completions.create(model="tiny", prompt=PROMPTS, n=2, best_of=4, **common,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.completion_token_ids for c in r.choices] == [o.outputs.token_ids for o in ref]
    assert [c.text for c in r.choices] == [o.outputs.text for o in ref]
    assert [c.prompt_token_ids for c in r.choices] == [o.prompt_token_ids for o in ref]
    # Every candidate generated counts (as OpenAI bills best_of); each prompt once.
    assert r.usage.completion_tokens == 2 * 4 * 8
    assert r.usage.prompt_tokens == len(ref[0].prompt_token_ids) + len(ref[2].prompt_token_ids)

    # best_of == n ranks nothing, so it streams, with what n alone gives.
    streamed = server.client().completions.create(model="tiny", prompt=PROMPTS[0], n=2, best_of=2, stream=True,
                                                  **common, extra_body={"ignore_eos": True})
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [o.outputs.text for o in every[:2]]


@pytest.mark.parametrize("scaled, normalized", [(True, False), (False, True), (True, True)])
def test_logprob_transforms_equal_the_offline_ones(server, llm, scaled, normalized):
    flags = {"temp_scaled_logprobs": scaled, "top_p_normalized_logprobs": normalized}
    common = dict(temperature=0.7, top_p=0.6, seed=5, max_tokens=4)
    params = SamplingParams(ignore_eos=True, logprobs=5, **common, **flags)
    ref = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs
    raw = llm.chat(MESSAGES, dataclasses.replace(params, temp_scaled_logprobs=False, top_p_normalized_logprobs=False),
                   use_tqdm=False)[0].outputs
    assert raw.token_ids == ref.token_ids  # the same tokens: the flags change only the reported logprobs
    assert any(abs(a[t].logprob - b[t].logprob) > 1e-3 for t, a, b in zip(ref.token_ids, ref.logprobs, raw.logprobs))

    r = server.client().chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=5,
                                                **common, extra_body={"ignore_eos": True, **flags})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for position, token, entry in zip(content, ref.token_ids, ref.logprobs):
        assert position.logprob == pytest.approx(entry[token].logprob, abs=1e-5)
        best = sorted(entry.values(), key=lambda lp: lp.rank)[:5]
        assert [t.logprob for t in position.top_logprobs] == pytest.approx([lp.logprob for lp in best], abs=1e-5)

    prompt = [5, 17, 99, 4, 250]
    ref = llm.generate([prompt], dataclasses.replace(params, logprobs=2), use_tqdm=False)[0].outputs
    r = server.client().completions.create(model="tiny", prompt=prompt, logprobs=2, **common,
                                           extra_body={"ignore_eos": True, **flags})
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(
        [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)], abs=1e-5)


@pytest.mark.parametrize("endpoint, body, match", [
    ("completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of must be an int >= n"),
    ("completions", {"prompt": "hi", "best_of": 2, "stream": True}, "cannot be used with stream"),
    ("completions", {"prompt": "hi", "best_of": "many"}, "best_of"),
    ("chat", {"messages": MESSAGES, "best_of": 2}, "best_of"),  # not a chat field, as in OpenAI and FastDeploy
    ("chat", {"messages": MESSAGES, "temp_scaled_logprobs": [1]}, "temp_scaled_logprobs"),
    ("completions", {"prompt": "hi", "top_p_normalized_logprobs": {}}, "top_p_normalized_logprobs"),
])
def test_bad_values_are_a_400_naming_the_field(server, endpoint, body, match):
    client = server.client()
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    standard = {k: v for k, v in body.items() if k in ("prompt", "messages", "n", "stream")}
    extra = {k: v for k, v in body.items() if k not in standard}
    with pytest.raises(openai.BadRequestError, match=match) as error:
        create(model="tiny", max_tokens=2, **standard, extra_body=extra)
    param = next(iter(extra))
    assert (error.value.status_code, error.value.param, error.value.type) == (400, param, "invalid_request_error")
    assert error.value.code == "400"
