"""Tools in the OpenAI server: the prompt and answer of a chat given tools equal LLM.chat's (server started with
--tool-call-parser, driven by the `openai` client), bad tools / tool_choice get 400s naming them, and the
tool calls' shapes in whole responses and streams (the app in-process with a stand-in parser, since the tiny
random model writes no <tool_call>)."""
from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import httpx
import openai
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.sampling_params import GuidedDecodingParams
from fastdeploy.entrypoints.multimodal import prompts_for
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.entrypoints.openai.engine_loop import EngineLoop
from fastdeploy.entrypoints.openai.serving import ServingContext
from test_api_server import KEY, MAX_MODEL_LEN, TIMEOUT_S, Server
from test_tool_calling import WEATHER, _WholeAnswerIsACall

QWEN3 = str(Path(__file__).parent / "fixtures" / "models" / "qwen3_tiny")
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    s = Server(QWEN3, "--api-key", KEY, "--tool-call-parser", "hermes", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def llm():
    return LLM(model=QWEN3, max_model_len=MAX_MODEL_LEN, tool_call_parser="hermes")


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_chat_with_tools_equals_llm_chat(server, llm, tool_choice):
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False, tools=[WEATHER])[0]
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    r = server.client().chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0,
                                                max_tokens=10, extra_body={"return_token_ids": True}, **extra)
    message = r.choices[0].message
    assert message.prompt_token_ids == ref.prompt_token_ids
    assert (message.content, message.tool_calls) == (ref.outputs.text, None)
    assert r.choices[0].finish_reason == ref.outputs.finish_reason
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0, max_tokens=10, stream=True, **extra))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ref.outputs.text and not any(d.tool_calls for d in deltas)


def test_tool_messages_render_as_llm_chat_does(server, llm):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, tools=[WEATHER])[0]
    r = server.client().chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], temperature=0,
                                                max_tokens=2, extra_body={"return_token_ids": True})
    assert r.choices[0].message.prompt_token_ids == ref.prompt_token_ids


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("extra, name, says", [
    ({"tools": "get_weather"}, "tools", "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools", "name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "JSON schema"),
])
def test_bad_tools_and_tool_choice_get_400(server, extra, name, says):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, **extra},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and says in error["message"]


UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}


def test_a_named_tool_choice_constrains_the_output_to_its_arguments(server, llm):
    # Greedy, the tiny model finishes the constrained object in ~60 tokens; the reference is LLM.chat under the
    # same JSON schema (the function's parameters).
    guided = GuidedDecodingParams(json=UNIT["function"]["parameters"])
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=100, guided_decoding=guided), use_tqdm=False,
                   tools=[UNIT])[0].outputs
    assert ref.finish_reason == "stop"
    args = dict(model="tiny", messages=MESSAGES, tools=[UNIT], temperature=0, max_tokens=100,
                tool_choice={"type": "function", "function": {"name": "set_unit"}})
    r = server.client().chat.completions.create(**args)
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("set_unit", json.loads(ref.text))
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "stop"  # as OpenAI for named
    chunks = list(server.client().chat.completions.create(**args, stream=True))
    items = [item for c in chunks if c.choices for item in c.choices[0].delta.tool_calls or []]
    assert [i.function.name for i in items] == ["set_unit", None]
    assert "".join(i.function.arguments for i in items) == call.function.arguments


def test_required_tool_choice_output_cut_short_stays_text(server, llm):
    # Greedy, the tiny model writes whitespace inside the constrained array until max_tokens: not a whole call,
    # so it is the message's content (as a malformed call is), and the text equals LLM.chat's under the schema.
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [{
        "type": "object", "properties": {"name": {"type": "string", "enum": ["set_unit"]},
                                         "parameters": UNIT["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False}]}}
    params = SamplingParams(temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(json=schema))
    ref = llm.chat(MESSAGES, params, use_tqdm=False, tools=[UNIT])[0].outputs
    r = server.client().chat.completions.create(model="tiny", messages=MESSAGES, tools=[UNIT], tool_choice="required",
                                                temperature=0, max_tokens=20)
    assert ref.text.startswith("[") and ref.finish_reason == "length"
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (ref.text, None)
    assert r.choices[0].finish_reason == "length"


def test_tool_calls_in_whole_and_streamed_responses(llm, monkeypatch):
    """Message.tool_calls, finish_reason "tool_calls" and delta.tool_calls as the openai client reads them."""
    greedy = SamplingParams(temperature=0, max_tokens=6)
    answer = llm.chat(MESSAGES, greedy, use_tqdm=False, tools=[WEATHER])[0].outputs.text
    monkeypatch.setattr(llm.engine.output_processor, "tool_parser", _WholeAnswerIsACall())
    loop = EngineLoop(llm.engine)
    ctx = ServingContext(llm.engine, loop, prompts_for(llm.config, llm.engine.tokenizer), "tiny")
    stepper = threading.Thread(target=loop.run, daemon=True)
    stepper.start()

    async def calls():
        transport = httpx.ASGITransport(app=build_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", http_client=http, max_retries=0)
            args = dict(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0, max_tokens=6)
            whole = await client.chat.completions.create(**args)
            stream = await client.chat.completions.create(**args, stream=True)
            return whole, [chunk async for chunk in stream]

    try:
        whole, chunks = asyncio.run(asyncio.wait_for(calls(), TIMEOUT_S))
    finally:
        loop.close()
        stepper.join(TIMEOUT_S)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "echo"
    assert json.loads(call.function.arguments) == {"text": answer}

    items = [(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices]
    items = [item for chunk_items in items for item in chunk_items]
    assert all(len(c.choices[0].delta.tool_calls or []) <= 1 for c in chunks if c.choices)
    first, second = items
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "echo", "")
    assert first.id.startswith("call_") and second.id is None and second.function.name is None
    assert second.function.arguments == call.function.arguments
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


# A Llama 3 JSON call, as the tiny random model writes it when guided by this pattern.
LLAMA_CALL = r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome|Oslo)"\}\}'


@pytest.fixture(scope="module")
def llama_templated(tmp_path_factory):
    """qwen3_tiny with Llama 3.1's own template (a checkpoint's chat_template.jinja wins over tokenizer_config)."""
    model = tmp_path_factory.mktemp("llama_template") / "qwen3_tiny"
    shutil.copytree(QWEN3, model)
    shutil.copy(Path(QWEN3).parent.parent / "templates" / "llama3_1_tools.jinja", model / "chat_template.jinja")
    return str(model)


def test_llama3_json_calls_through_the_server(llama_templated):
    """--tool-call-parser llama3_json: the prompt is Llama's (tools in the first user turn), and the call the model
    writes comes back as message.tool_calls / delta.tool_calls, as LLM.chat parses it."""
    # Llama's template lists the tools as indented JSON: a longer context than the other tests'.
    llm = LLM(model=llama_templated, max_model_len=1024, tool_call_parser="llama3_json")
    params = SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(regex=LLAMA_CALL))
    ref = llm.chat(MESSAGES, params, use_tqdm=False, tools=[WEATHER])[0]
    assert "Environment: ipython" in ref.prompt and "Given the following functions" in ref.prompt
    [ref_call] = ref.outputs.tool_calls
    written = json.loads(llm.get_tokenizer().decode(ref.outputs.token_ids))
    assert ref.outputs.text == "" and ref.outputs.finish_reason == "stop"
    assert (ref_call["function"]["name"], json.loads(ref_call["function"]["arguments"])) == \
        (written["name"], written["parameters"])
    server = Server(llama_templated, "--tool-call-parser", "llama3_json", "--served-model-name", "tiny",
                    "--max-model-len", "1024")
    try:
        args = dict(model="tiny", messages=MESSAGES, tools=[WEATHER], temperature=0, max_tokens=40,
                    extra_body={"guided_regex": LLAMA_CALL, "return_token_ids": True})
        r = server.client().chat.completions.create(**args)
        choice = r.choices[0]
        assert choice.message.prompt_token_ids == ref.prompt_token_ids
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert (call.function.name, call.function.arguments) == (ref_call["function"]["name"],
                                                                 ref_call["function"]["arguments"])
        args["extra_body"] = {"guided_regex": LLAMA_CALL}
        chunks = list(server.client().chat.completions.create(**args, stream=True))
        items = [item for c in chunks if c.choices for item in c.choices[0].delta.tool_calls or []]
        assert [i.function.name for i in items] == ["get_weather", None]
        assert "".join(i.function.arguments for i in items) == call.function.arguments
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    finally:
        assert server.stop() == 0
