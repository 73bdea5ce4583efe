"""A FastDeploy user's request bodies and launch lines work unchanged (issue 43, points 3 and 4): FastDeploy's
request extras on both endpoints do what FastDeploy documents or are refused naming the field, its server flags
parse (refused at start-up where they have no meaning here), and /ping, /config-info, /tokenize, /detokenize
answer. One server on 127.0.0.1; results checked against LLM.generate on the same model."""
from __future__ import annotations

import json

import httpx
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.entrypoints.openai.api_server import main
from fastdeploy.entrypoints.openai.cli_args import check_fastdeploy_server_flags, make_parser

from test_api_server import KEY, MAX_MODEL_LEN, TIMEOUT_S, Server

AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "The quick brown fox"
IDS = [5, 17, 99, 4, 250]


@pytest.fixture(scope="module")
def server(tiny_hf):
    s = Server(tiny_hf, "--api-key", KEY, "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, max_model_len=MAX_MODEL_LEN)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def post(server: Server, path: str, body: dict, auth: bool = True) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH if auth else {}, timeout=TIMEOUT_S)


def chat(server: Server, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return post(server, "/v1/chat/completions", {"temperature": 0, "max_tokens": 6, "ignore_eos": True, **body})


def completion(server: Server, **body) -> httpx.Response:
    return post(server, "/v1/completions", {"temperature": 0, "max_tokens": 6, "ignore_eos": True, **body})


def events(r: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---------------------------------------------------------------------------------- request extras


def test_request_id_becomes_the_response_id_with_fastdeploys_prefix(server):
    assert chat(server, request_id="trace-7").json()["id"] == "chatcmpl-trace-7"
    assert chat(server, request_id="chatcmpl-x").json()["id"] == "chatcmpl-x"  # prefix kept, not doubled
    assert completion(server, prompt=TEXT, request_id="trace-8").json()["id"] == "cmpl-trace-8"
    streamed = events(completion(server, prompt=TEXT, request_id="s1", stream=True))
    assert {e["id"] for e in streamed} == {"cmpl-s1"}
    # Two calls may share an id: it labels the responses only, the engine's own ids stay apart.
    assert chat(server, request_id="trace-7").status_code == 200
    for bad in ("has space", "x" * 257, "", "\u00e9t\u00e9"):
        r = chat(server, request_id=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", bad


def test_chat_prompt_token_ids_are_the_prompt_and_skip_the_template(server, llm):
    ref = llm.generate([IDS], greedy(max_tokens=6), use_tqdm=False)[0]
    for messages in ([], [{"role": "user", "content": "not rendered"}]):
        r = chat(server, messages=messages, prompt_token_ids=IDS, return_token_ids=True).json()
        message = r["choices"][0]["message"]
        assert (message["prompt_token_ids"], message["completion_token_ids"]) == (IDS, ref.outputs.token_ids)
        assert message["content"] == ref.outputs.text and r["usage"]["prompt_tokens"] == len(IDS)
    media = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert chat(server, messages=media, prompt_token_ids=IDS).json()["error"]["param"] == "messages"
    assert chat(server, prompt_token_ids=[5, 10**6]).status_code == 400  # ids range-checked by the engine
    assert chat(server, messages=[]).json()["error"]["param"] == "messages"  # neither messages nor ids


def test_disable_chat_template_takes_the_message_as_the_raw_prompt(server, llm):
    ref = llm.generate([TEXT], greedy(max_tokens=6), use_tqdm=False)[0]
    r = chat(server, messages=[{"role": "user", "content": TEXT}], disable_chat_template=True, return_token_ids=True)
    message = r.json()["choices"][0]["message"]
    assert (message["prompt_token_ids"], message["completion_token_ids"]) == (ref.prompt_token_ids,
                                                                              ref.outputs.token_ids)
    two = [{"role": "system", "content": "a"}, {"role": "user", "content": TEXT}]
    assert chat(server, messages=two, disable_chat_template=True).json()["error"]["param"] == "disable_chat_template"
    r = chat(server, disable_chat_template=True, chat_template="{{ 1 }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_completion_prompt_token_ids_are_used_instead_of_tokenizing(server, llm):
    prompts = [IDS, [7, 8, 9]]
    ref = llm.generate(prompts, greedy(max_tokens=6), use_tqdm=False)
    r = completion(server, prompt=["first", "second"], prompt_token_ids=prompts, return_token_ids=True).json()
    assert [c["prompt_token_ids"] for c in r["choices"]] == prompts
    assert [c["text"] for c in r["choices"]] == [o.outputs.text for o in ref]
    assert completion(server, prompt_token_ids=IDS).json()["choices"][0]["text"] == ref[0].outputs.text
    assert completion(server, prompt="one", prompt_token_ids=prompts).json()["error"]["param"] == "prompt_token_ids"
    assert completion(server, prompt=IDS, prompt_token_ids=IDS).json()["error"]["param"] == "prompt"
    assert completion(server).json()["error"]["param"] == "prompt"


def test_max_streaming_response_tokens_groups_tokens_per_chunk(server, llm):
    ref = llm.generate([TEXT], greedy(max_tokens=10), use_tqdm=False)[0]
    chunks = events(completion(server, prompt=TEXT, max_tokens=10, stream=True, return_token_ids=True,
                               max_streaming_response_tokens=4))
    sizes = [len(c["choices"]) for c in chunks]
    assert max(sizes) == 4 and all(len(c.get("completion_token_ids") or []) <= 1
                                   for e in chunks for c in e["choices"])
    assert [t for e in chunks for c in e["choices"] for t in c["completion_token_ids"]] == ref.outputs.token_ids
    assert "".join(c["text"] for e in chunks for c in e["choices"]) == ref.outputs.text
    assert chunks[-1]["choices"][-1]["finish_reason"] == "length"
    chat_chunks = events(chat(server, max_tokens=10, stream=True, max_streaming_response_tokens=3))
    assert max(len(e["choices"]) for e in chat_chunks) == 3
    assert chat(server, max_streaming_response_tokens=0).json()["error"]["param"] == "max_streaming_response_tokens"


def test_logits_processors_args_carry_logit_bias(server, llm):
    bias = {"logit_bias": {"42": 100.0}}
    ref = llm.generate([TEXT], greedy(max_tokens=4, logits_processors_args=bias), use_tqdm=False)[0]
    assert ref.outputs.token_ids == [42] * 4
    r = completion(server, prompt=TEXT, max_tokens=4, logits_processors_args=bias, return_token_ids=True).json()
    assert r["choices"][0]["completion_token_ids"] == ref.outputs.token_ids
    assert chat(server, logits_processors_args={}).status_code == 200
    assert chat(server, logits_processors_args=None).status_code == 200
    both = chat(server, logit_bias={"1": 1.0}, logits_processors_args={"logit_bias": {"2": 1.0}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "logits_processors_args"


def test_bad_words_on_both_endpoints(server, llm):
    plain = llm.generate([TEXT], greedy(max_tokens=6), use_tqdm=False)[0].outputs.text
    word = plain.split()[0] if plain.split() else plain[:2]
    ref = llm.generate([TEXT], greedy(max_tokens=6, bad_words=[word]), use_tqdm=False)[0]
    assert completion(server, prompt=TEXT, bad_words=[word]).json()["choices"][0]["text"] == ref.outputs.text
    assert chat(server, bad_words=[word]).status_code == 200


@pytest.mark.parametrize("field, refused, neutral", [
    ("mm_hashes", ["0123abcd"], []),
    ("metadata", {"max_streaming_response_tokens": 2}, {}),
    ("logits_processors_args", {"my_processor": {"k": 1}}, {}),
])
def test_extras_without_meaning_here_are_refused_naming_them(server, field, refused, neutral):
    for send in (chat, lambda s, **b: completion(s, prompt=TEXT, **b)):
        if field == "metadata" and send is not chat:
            continue  # FastDeploy's completions have no metadata: unknown there, refused as such
        r = send(server, **{field: refused})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
        assert send(server, **{field: neutral}).status_code == 200


# ---------------------------------------------------------------------------------- endpoints


def test_ping_and_config_info_tell_no_secrets(server, tiny_hf):
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{server.url}/ping", timeout=10).status_code == 200  # open, as /health
    assert httpx.get(f"{server.url}/config-info", timeout=10).status_code == 401
    r = httpx.get(f"{server.url}/config-info", headers=AUTH, timeout=10)
    info = r.json()
    assert info["model"] == "tiny" and info["engine"]["max_model_len"] == MAX_MODEL_LEN
    assert KEY not in r.text and str(tiny_hf) not in r.text and "ernie45_tiny_hf" not in r.text
    assert "seed" not in info["engine"] and "chat_template" not in info["engine"]


def test_tokenize_and_detokenize_in_vllms_shapes(server, llm):
    tokenizer = llm.engine.tokenizer
    r = post(server, "/tokenize", {"model": "tiny", "prompt": TEXT, "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode(TEXT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and len(r["token_strs"]) == r["count"]
    messages = [{"role": "user", "content": "hi"}]
    tokens = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    answered = chat(server, messages=messages, max_tokens=1, return_token_ids=True).json()
    assert tokens == answered["choices"][0]["message"]["prompt_token_ids"]  # as the chat endpoint renders it
    assert post(server, "/detokenize", {"tokens": IDS}).json() == {"prompt": tokenizer.decode(IDS, False)}
    for body, param in (({"tokens": [1, -1]}, "tokens"), ({"tokens": [10**30]}, "tokens"),
                        ({"prompt": "a", "messages": messages}, "prompt"), ({"prompt": "a", "x": 1}, "x")):
        path = "/detokenize" if "tokens" in body else "/tokenize"
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body
    assert post(server, "/tokenize", {"prompt": "a", "model": "other"}).status_code == 404
    assert post(server, "/tokenize", {"prompt": "a"}, auth=False).status_code == 401
    assert post(server, "/detokenize", {"tokens": [1]}, auth=False).status_code == 401


# ---------------------------------------------------------------------------------- launch flags


def test_fastdeploy_server_flags_parse_and_are_refused_where_meaningless(capsys):
    base = ["--model", "m"]
    check_fastdeploy_server_flags(make_parser().parse_args(
        [*base, "--workers", "1", "--controller-port", "-1", "--timeout", "0"]))
    for flags in (["--workers", "4"], ["--controller-port", "8200"], ["--enable-mm-output"], ["--timeout", "30"]):
        with pytest.raises(ValueError, match=f"^{flags[0]}"):
            check_fastdeploy_server_flags(make_parser().parse_args([*base, *flags]))
    with pytest.raises(SystemExit) as stopped:  # before the engine loads
        main([*base, "--workers", "2"])
    assert stopped.value.code == 2 and "--workers 2" in capsys.readouterr().err
