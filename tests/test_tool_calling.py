"""Tool calling: chat templates with tools against transformers' apply_chat_template
(tests/fixtures/reference/tool_calling_reference.json, tools/make_tool_calling_reference.py), the tool-call
parsers on recorded model outputs, and their stream deltas joined against the whole result."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.request import Request, RequestMetrics
from fastdeploy.entrypoints.prompts import TextPrompts
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.engine.output_processor import OutputProcessor
from fastdeploy.reasoning.parsers import get_reasoning_parser
from fastdeploy.tool_parsers import (
    ParsedCall, ToolCallSplit, ToolParser, check_tool_choice, check_tools, get_tool_parser, join_call_deltas)

FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "reference" / "tool_calling_reference.json").read_text(encoding="utf-8"))
QWEN3 = FIXTURES / "models" / "qwen3_tiny"
ERNIE = FIXTURES / "models" / "ernie45_tiny_hf"
WEATHER = REF["cases"][0]["tools"][0]


# ---- rendering ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", sorted(REF["fixtures"]))
def test_renders_with_tools_match_transformers(fixture):
    prompts = TextPrompts(Tokenizer.from_pretrained(FIXTURES / "models" / fixture))
    cases = {c["name"]: c for c in REF["cases"]}
    entries = REF["fixtures"][fixture]
    assert len(entries) == 36 and sum("error" not in e for e in entries) >= 30
    for entry in entries:
        case = cases[entry["case"]]
        template = (FIXTURES / "templates" / entry["template"]).read_text() if entry["template"] else None
        args = (case["messages"], entry["kwargs"], template, case["tools"])
        if "error" in entry:
            with pytest.raises(ValueError):
                prompts.from_chat(*args)
            continue
        text, ids, _ = prompts.from_chat(*args)
        assert (text, ids) == (entry["text"], entry["ids"]), (fixture, entry["template"], entry["case"])


def test_an_assistant_message_with_calls_may_leave_out_content():
    prompts = TextPrompts(Tokenizer.from_pretrained(QWEN3))
    template = (FIXTURES / "templates" / "hermes_tools.jinja").read_text()
    case = next(c for c in REF["cases"] if c["name"] == "call_and_result")
    without = [{k: v for k, v in m.items() if v is not None} for m in case["messages"]]
    assert "content" not in without[1]
    assert prompts.from_chat(without, None, template, case["tools"]) == \
        prompts.from_chat(case["messages"], None, template, case["tools"])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        prompts.from_chat([{"role": "user"}], None, template, None)


def test_tools_and_tool_choice_are_checked():
    assert check_tools(None) is None and check_tools([]) is None
    assert check_tools(WEATHER) == [WEATHER]  # one tool alone is a list of one
    for bad, kind in [("get_weather", TypeError), ([["x"]], TypeError), ([{"type": "function"}], ValueError),
                      ([{"type": "code", "function": {"name": "f"}}], ValueError),
                      ([{"type": "function", "function": {"name": ""}}], ValueError),
                      ([{"type": "function", "function": {"name": "f", "parameters": []}}], ValueError)]:
        with pytest.raises(kind, match=r"tools"):
            check_tools(bad)
    tools = [WEATHER]
    assert check_tool_choice(None, tools) == "auto" and check_tool_choice(None, None) == "none"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tool_choice(named, tools) == named
    for bad in ["any", {"type": "function", "function": {"name": "nope"}}, {"function": "get_weather"}]:
        with pytest.raises(ValueError, match="tool_choice"):
            check_tool_choice(bad, tools)
    with pytest.raises(ValueError, match="needs tools"):
        check_tool_choice("required", None)


# ---- parsers on recorded outputs -----------------------------------------------------------------
# Outputs in the formats the models write (ERNIE-X1's after its thinking part, Qwen/Hermes' <tool_call>).
QWEN_TWO_CALLS = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "巴黎", '
                  '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
                  '{"query": "Paris \\"events\\"", "top_k": 3}}\n</tool_call>')
QWEN_BAD_THEN_GOOD = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nretrying\n'
                      '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\nDone.')
ERNIE_CALL = ('The user wants the weather; I should call get_weather.\n</think>\n\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "北京"}}\n</tool_call>\n')


def calls_of(split: ToolCallSplit) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in split.calls]


@pytest.mark.parametrize("name", ["hermes", "ernie-x1"])
def test_text_before_and_after_calls_and_several_calls(name):
    parser = get_tool_parser(name)
    split = parser.split(QWEN_TWO_CALLS, final=True)
    assert split.text == "I will look both up.\n"
    assert calls_of(split) == [("get_weather", {"city": "巴黎", "unit": "celsius"}),
                               ("search", {"query": 'Paris "events"', "top_k": 3})]
    assert split.calls[0].arguments == '{"city": "巴黎", "unit": "celsius"}'  # JSON text, non-ASCII kept
    after = parser.split("x <tool_call>{\"name\": \"now\"}</tool_call> \n and after", final=True)
    assert after.text == "x and after" and calls_of(after) == [("now", {})]


@pytest.mark.parametrize("name", ["hermes", "ernie-x1"])
def test_malformed_calls_stay_in_the_text(name):
    parser = get_tool_parser(name)
    split = parser.split(QWEN_BAD_THEN_GOOD, final=True)
    assert split.text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nretrying\nDone.'
    assert calls_of(split) == [("search", {})]
    for body in ['[1, 2]', '{"arguments": {}}', '{"name": 3}', '{"name": "f", "arguments": [1]}',
                 '{"name": "f", "arguments": "not json"}', 'plain words']:
        text = f"a<tool_call>{body}</tool_call>b"
        assert parser.split(text, final=True) == ToolCallSplit(text, []), body
    # arguments written as a JSON string holding an object count as that object
    assert calls_of(parser.split('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', True)) == \
        [("f", {"a": 1})]


def test_an_unclosed_last_call_counts_only_for_hermes():
    text = 'ok <tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n'
    assert get_tool_parser("hermes").split(text, final=True) == ToolCallSplit(
        "ok ", [ParsedCall("search", '{"query": "q"}')])
    assert get_tool_parser("ernie-x1").split(text, final=True) == ToolCallSplit(text, [])
    cut = 'ok <tool_call>\n{"name": "search", "argu'  # cut by max_tokens: not a call for either
    for name in ("hermes", "ernie-x1"):
        assert get_tool_parser(name).split(cut, final=True) == ToolCallSplit(cut, [])


KNOWN = r"\['ernie-45-vl-thinking', 'ernie-x1', 'ernie_45-vl-thinking', 'hermes', 'llama3_json', 'mistral'\]"


def test_unknown_parser_names_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match=r"tool_call_parser must be one of " + KNOWN):
        get_tool_parser("qwen")
    with pytest.raises(ValueError, match=r"tool_call_parser must be one of " + KNOWN + " or None"):
        LLM(model=str(QWEN3), tool_call_parser="pythonic")


VL_CALLS = '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "search", "arguments": {"query": "q"}}'


@pytest.mark.parametrize("name", ["ernie-45-vl-thinking", "ernie_45-vl-thinking"])
def test_ernie_45_vl_thinking_calls_or_an_answer(name):
    """FastDeploy's ernie-45-vl-thinking: the content after the thinking part is calls only (the last may be left
    open) or an answer; text beside the calls, or a block that is no call, makes all of it the answer."""
    parser = get_tool_parser(name)
    assert parser.split(VL_CALLS, final=True) == ToolCallSplit(
        "", [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("search", '{"query": "q"}')])
    for answer in ["The weather is fine.", "Let me call: " + VL_CALLS, VL_CALLS + "\n</tool_call>\nand more",
                   "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>"]:
        assert parser.split(answer, final=True) == ToolCallSplit(answer, []), answer
    assert parser.split("\n<tool_", final=False) == ToolCallSplit("", [])  # not yet known
    assert parser.split("Hello", final=False) == ToolCallSplit("Hello", [])


@pytest.fixture
def restored_parsers():
    """The parser registry as it was after the test (a plugin registers into the process-wide one)."""
    from fastdeploy.tool_parsers import parsers, plugins

    saved, loaded = dict(parsers.PARSERS), dict(plugins._loaded)
    yield
    parsers.PARSERS.clear()
    parsers.PARSERS.update(saved)
    plugins._loaded.clear()
    plugins._loaded.update(loaded)


def test_tool_parser_plugin_registers_a_parser_by_name(tmp_path, restored_parsers):
    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(
        "from fastdeploy.tool_parsers import ToolParser, register_tool_parser\n"
        "@register_tool_parser\n"
        "class Bracketed(ToolParser):\n"
        "    name = 'bracketed'\n"
        "    START, END = '[[', ']]'\n")
    llm = LLM(model=str(QWEN3), max_model_len=64, tool_parser_plugin=str(plugin), tool_call_parser="bracketed")
    parser = llm.engine.output_processor.tool_parser
    assert parser.split('a [[{"name": "f", "arguments": {"x": 1}}]] b', final=True) == \
        ToolCallSplit("a b", [ParsedCall("f", '{"x": 1}')])
    fastdeploy_style = tmp_path / "fd_style.py"
    fastdeploy_style.write_text("from fastdeploy.entrypoints.openai.tool_parsers import ToolParserManager\n")
    with pytest.raises(ValueError, match="tool_parser_plugin.*ToolParserManager interface is not provided"):
        LLM(model=str(QWEN3), tool_parser_plugin=str(fastdeploy_style))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="tool_parser_plugin.*registered no parser"):
        LLM(model=str(QWEN3), tool_parser_plugin=str(empty))
    with pytest.raises(ValueError, match="tool_parser_plugin must be a .py file"):
        LLM(model=str(QWEN3), tool_parser_plugin=str(tmp_path / "missing.py"))
    from fastdeploy.entrypoints.openai.cli_args import engine_config, make_parser  # the server's flag
    args = make_parser().parse_args(["--model", str(QWEN3), "--tool-parser-plugin", str(plugin),
                                     "--tool-call-parser", "bracketed"])
    assert engine_config(args).tool_call_parser == "bracketed"


@pytest.mark.parametrize("name", ["hermes", "ernie-x1", "ernie-45-vl-thinking"])
@pytest.mark.parametrize("text", [QWEN_TWO_CALLS, QWEN_BAD_THEN_GOOD, "no calls <tool_ at all <tool_call", VL_CALLS])
def test_every_prefix_split_is_a_prefix_of_the_final_split(name, text):
    parser = get_tool_parser(name)
    final = parser.split(text, final=True)
    for end in range(len(text) + 1):
        part = parser.split(text[:end], final=False)
        assert final.text.startswith(part.text) and final.calls[:len(part.calls)] == part.calls, end


# ---- Llama 3.x JSON calls (llama3_json) and Mistral's [TOOL_CALLS] (mistral) ----------------------------
CHAT_REF = json.loads((FIXTURES / "reference" / "chat_template_reference.json").read_text(encoding="utf-8"))


def _calls_in(messages: list[dict]) -> list[tuple[str, dict]]:
    """The calls of a conversation's assistant messages, arguments as objects."""
    return [(c["function"]["name"], c["function"]["arguments"] if isinstance(c["function"]["arguments"], dict)
             else json.loads(c["function"]["arguments"])) for m in messages for c in m.get("tool_calls") or []]


def test_llama3_json_reads_the_calls_llamas_template_writes():
    """The assistant turns transformers rendered with Llama 3.1 / 3.2's own templates (the format the model
    learned) parse back into the conversation's calls; a builtin tool's `<|python_tag|>name.call(...)` is not
    JSON and stays text."""
    parser, checked = get_tool_parser("llama3_json"), 0
    for case in CHAT_REF["cases"]:
        if case["chat_template"] not in ("llama3_1_tools", "llama3_2_tools") or "text" not in case:
            continue
        for turn in case["text"].split("<|start_header_id|>assistant<|end_header_id|>\n\n")[1:]:
            body = turn.split("<|eot_id|>")[0].split("<|eom_id|>")[0]
            split = parser.split(body, final=True)
            if body.startswith("<|python_tag|>"):
                assert split == ToolCallSplit(body, []), body
            elif body.startswith("{"):
                assert split.text == "" and calls_of(split) == _calls_in(case["messages"]), body
                checked += 1
            else:
                assert split == ToolCallSplit(body, [])
    assert checked >= 20


def test_mistral_reads_the_calls_mistrals_template_writes():
    parser, checked = get_tool_parser("mistral"), 0
    for case in CHAT_REF["cases"]:
        if case["chat_template"] != "mistral_v0_3_tools" or "[TOOL_CALLS]" not in case.get("text", ""):
            continue
        eos = Tokenizer.from_pretrained(FIXTURES / case["source"]).eos_token
        rendered = case["text"][case["text"].index("[TOOL_CALLS]"):].split("[TOOL_RESULTS]")[0]
        split = parser.split(rendered.replace(eos, ""), final=True)
        assert split.text == "" and calls_of(split) == _calls_in(case["messages"]), rendered
        checked += 1
    assert checked >= 20


LLAMA_TWO_CALLS = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "巴黎", "unit": "celsius"}}; '
                   '{"name": "search", "arguments": {"query": "Paris \\"events\\"", "top_k": 3}}')
LLAMA_TEXT_THEN_CALL = 'Let me look.\n<|python_tag|>{"name": "search", "parameters": "{\\"query\\": \\"q\\"}"}'
LLAMA_BAD = '{"name": "get_weather", "parameters": {"city": }}; {"name": "search", "parameters": {}}'
MISTRAL_TWO_CALLS = ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "巴黎"}}, '
                     '{"name": "search", "arguments": {"query": "q", "top_k": 3}}] ')


def test_llama3_json_calls_text_and_malformed_objects():
    parser = get_tool_parser("llama3_json")
    assert parser.split(LLAMA_TWO_CALLS, final=True) == ToolCallSplit("", [
        ParsedCall("get_weather", '{"city": "巴黎", "unit": "celsius"}'),
        ParsedCall("search", '{"query": "Paris \\"events\\"", "top_k": 3}')])
    # text before the tag stays; arguments written as a JSON string count as that object
    assert parser.split(LLAMA_TEXT_THEN_CALL, final=True) == ToolCallSplit(
        "Let me look.\n", [ParsedCall("search", '{"query": "q"}')])
    # without the tag the calls must open the answer (whitespace aside); text after them stays text
    assert parser.split(' \n{"name": "now", "parameters": {}} Done.', final=True) == ToolCallSplit(
        " Done.", [ParsedCall("now", "{}")])
    # malformed JSON: from there on all is text, as written
    assert parser.split(LLAMA_BAD, final=True) == ToolCallSplit(LLAMA_BAD, [])
    for text in ['Answer: {"name": "now", "parameters": {}}',  # JSON not opening the answer (no tag)
                 '{"answer": 42}', '{"name": "now"}', '{"name": "f", "parameters": {}, "arguments": {}}',
                 '{"name": "f", "parameters": [1]}', '<|python_tag|>brave_search.call(query="x")',
                 '{"name": "f", "parameters": {"a": 1}', '<|python_tag|>']:
        assert parser.split(text, final=True) == ToolCallSplit(text, []), text
    # an object that is no call stays text among calls
    assert parser.split('{"x": 1}; {"name": "now", "parameters": {}}', final=True) == ToolCallSplit(
        '{"x": 1}', [ParsedCall("now", "{}")])
    assert parser.split('  ', final=False) == ToolCallSplit("", [])  # the answer may still open with a call
    assert parser.split('Hi <|python', final=False) == ToolCallSplit("Hi ", [])


def test_mistral_calls_text_and_malformed_arrays():
    parser = get_tool_parser("mistral")
    assert parser.split(MISTRAL_TWO_CALLS, final=True) == ToolCallSplit("Sure.", [
        ParsedCall("get_weather", '{"city": "巴黎"}'), ParsedCall("search", '{"query": "q", "top_k": 3}')])
    for text in ['[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}]', '[TOOL_CALLS] {"name": "f", "arguments": {}}',
                 '[TOOL_CALLS] []', '[TOOL_CALLS] [{"name": "f"}]', '[TOOL_CALLS] [{"name": "f", "arguments": {}}, 3]',
                 'x [TOOL_CALLS] [{"name": "f", "arguments": {}}', '[TOOL_CALLS]']:
        assert parser.split(text, final=True) == ToolCallSplit(text, []), text
    assert parser.split("ok [TOOL_", final=False) == ToolCallSplit("ok ", [])
    # ids Mistral's template takes back: 9 letters and digits
    ids = {parser.new_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert get_tool_parser("hermes").new_call_id().startswith("call_")


@pytest.mark.parametrize("name, text", [
    ("llama3_json", LLAMA_TWO_CALLS), ("llama3_json", LLAMA_TEXT_THEN_CALL), ("llama3_json", LLAMA_BAD),
    ("llama3_json", '{"x": 1}; {"name": "now", "parameters": {}} ; tail'), ("llama3_json", "plain <|python answer"),
    ("mistral", MISTRAL_TWO_CALLS), ("mistral", '[TOOL_CALLS] [{"name": "f"}] then [TOOL_CALLS] [{"name": "g", '
                                                '"arguments": {}}] end'), ("mistral", "no [TOOL_ calls")])
def test_every_prefix_split_of_the_json_formats_is_a_prefix_of_the_final_split(name, text):
    parser = get_tool_parser(name)
    final = parser.split(text, final=True)
    for end in range(len(text) + 1):
        part = parser.split(text[:end], final=False)
        assert final.text.startswith(part.text) and final.calls[:len(part.calls)] == part.calls, end


def test_forced_call_parsers():
    from fastdeploy.tool_parsers.forced import NamedCallParser, RequiredCallsParser, forced_call_schema
    named = NamedCallParser("get_weather")
    assert named.split('{"city": "x"}', final=False) == ToolCallSplit("", [])  # nothing is sure until the end
    assert named.split(' {"city" : "巴黎"} ', final=True) == ToolCallSplit(
        "", [ParsedCall("get_weather", '{"city": "巴黎"}')])
    assert named.split('{"city": "x', final=True) == ToolCallSplit('{"city": "x', [])
    required = RequiredCallsParser()
    text = '[{"name": "get_weather", "parameters": {"city": "x"}}, {"name": "now", "parameters": {}}]'
    assert calls_of(required.split(text, final=True)) == [("get_weather", {"city": "x"}), ("now", {})]
    for bad in ["[]", '[{"name": "now"}]', '{"name": "now", "parameters": {}}', "[{"]:
        assert required.split(bad, final=True) == ToolCallSplit(bad, []), bad
    assert forced_call_schema({"type": "function", "function": {"name": "get_weather"}}, [WEATHER]) == \
        WEATHER["function"]["parameters"]
    schema = forced_call_schema("required", [WEATHER, {"type": "function", "function": {"name": "now"}}])
    assert schema["minItems"] == 1 and [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == \
        [["get_weather"], ["now"]]


# ---- through the output processor: whole output vs stream deltas ---------------------------------
def _request(number: int, prompt: list[int]) -> Request:
    return Request(request_id=f"t{number}", prompt_token_ids=prompt, params=SamplingParams(), max_tokens=1000,
                   eos_token_ids=frozenset(), generator=np.random.default_rng(0), metrics=RequestMetrics(0.0))


def run_output(processor: OutputProcessor, ids: list[int], stream: bool, number: int, tool_calls: bool = True,
               thinking: bool = True):
    """Feed `ids` as a request's output tokens, as the engine does; the final output, or every delta."""
    request = _request(number, [1, 2, 3])
    processor.start(request, None, 0, thinking, tool_calls)
    deltas = []
    for i, token in enumerate(ids):
        request.token_ids.append(token)
        if i == len(ids) - 1:
            request.finish("stop")
        processor.on_token(request, token)
        if stream:
            deltas.append(processor.make_output(request, delta=True))
    return deltas if stream else processor.make_output(request)


def joined(deltas) -> tuple[str, str | None, list[dict] | None]:
    text = "".join(d.outputs.text for d in deltas)
    reasoning = [d.outputs.reasoning_content for d in deltas]
    items = [item for d in deltas for item in d.outputs.tool_calls or []]
    return text, None if reasoning[0] is None else "".join(reasoning), join_call_deltas(items) or None


@pytest.mark.parametrize("name, text", [
    ("hermes", QWEN_TWO_CALLS), ("hermes", QWEN_BAD_THEN_GOOD), ("ernie-x1", QWEN_TWO_CALLS),
    ("ernie-x1", QWEN_BAD_THEN_GOOD), ("llama3_json", LLAMA_TWO_CALLS), ("llama3_json", LLAMA_TEXT_THEN_CALL),
    ("mistral", MISTRAL_TWO_CALLS)])
def test_stream_deltas_join_to_the_whole_output(name, text):
    tok = Tokenizer.from_pretrained(QWEN3)
    processor = OutputProcessor(tok, None, get_tool_parser(name))
    ids = tok.encode(text, add_special_tokens=False)
    whole = run_output(processor, ids, stream=False, number=0).outputs
    split = get_tool_parser(name).split(tok.decode(ids), final=True)
    assert whole.text == split.text and whole.finish_reason == "stop"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls] == \
        [(c.name, c.arguments) for c in split.calls]
    id_ok = (lambda i: len(i) == 9 and i.isalnum()) if name == "mistral" else (lambda i: i.startswith("call_"))
    assert all(id_ok(c["id"]) and c["type"] == "function" for c in whole.tool_calls)
    deltas = run_output(processor, ids, stream=True, number=1)
    text_s, _, calls_s = joined(deltas)
    assert text_s == whole.text
    assert [{**c, "id": None} for c in calls_s] == [{**c, "id": None} for c in whole.tool_calls]
    assert len({c["id"] for c in calls_s}) == len(calls_s)
    # OpenAI's delta shape: the first item of a call has its id, type and name; the next its arguments
    items = [item for d in deltas for item in d.outputs.tool_calls or []]
    assert items[0]["type"] == "function" and items[0]["function"] == {"name": split.calls[0].name, "arguments": ""}
    assert "id" not in items[1] and items[1]["function"] == {"arguments": split.calls[0].arguments}
    assert not processor.states


def test_calls_come_from_the_content_not_the_reasoning():
    tok = Tokenizer.from_pretrained(ERNIE)
    processor = OutputProcessor(tok, get_reasoning_parser("ernie-x1"), get_tool_parser("ernie-x1"))
    thinking_call = ('maybe <tool_call>{"name": "search", "arguments": {}}</tool_call>?\n' + ERNIE_CALL)
    ids = tok.encode(thinking_call, add_special_tokens=False)
    whole = run_output(processor, ids, stream=False, number=0).outputs
    assert whole.reasoning_content.startswith("maybe <tool_call>") and whole.text == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls] == \
        [("get_weather", {"city": "北京"})]
    text, reasoning, calls = joined(run_output(processor, ids, stream=True, number=1))
    assert (text, reasoning) == (whole.text, whole.reasoning_content)
    assert [c["function"] for c in calls] == [c["function"] for c in whole.tool_calls]
    # without tools the reasoning parser still drops the call from the text, as before
    plain = run_output(processor, ids, stream=False, number=2, tool_calls=False).outputs
    assert plain.text == "" and plain.tool_calls is None and plain.reasoning_content == whole.reasoning_content


@pytest.mark.parametrize("name, text, kept", [("mistral", MISTRAL_TWO_CALLS, "[TOOL_CALLS]"),
                                              ("llama3_json", LLAMA_TEXT_THEN_CALL, "<|python_tag|>")])
def test_a_parsers_marker_survives_skipping_special_tokens(tmp_path, name, text, kept):
    """Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are special tokens, which outputs leave out by default
    (skip_special_tokens): the detokenizer keeps the request's parser's markers, and only those."""
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_bytes((QWEN3 / file).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] += ["[TOOL_CALLS]", "<|python_tag|>"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    assert tok.encode(kept, add_special_tokens=False) == [tok.token_to_id(kept)] and kept not in tok.decode(ids)
    expected = get_tool_parser(name).split(text, final=True)
    processor = OutputProcessor(tok, None, get_tool_parser(name))
    whole = run_output(processor, ids, stream=False, number=0).outputs
    assert whole.text == expected.text and len(expected.calls) > 0
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls] == \
        [(c.name, c.arguments) for c in expected.calls]
    streamed, _, calls = joined(run_output(processor, ids, stream=True, number=1))
    assert streamed == whole.text and [c["function"] for c in calls] == [c["function"] for c in whole.tool_calls]
    # another parser's request (and the eos token) still skip them
    other = run_output(OutputProcessor(tok, None, get_tool_parser("hermes")), ids, stream=False, number=2).outputs
    assert other.text == tok.decode(ids) and kept not in other.text


# ---- LLM.chat -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(QWEN3), max_model_len=256, tool_call_parser="hermes")


class _WholeAnswerIsACall(ToolParser):
    """A stand-in parser for the tiny random model (which writes no <tool_call>): its whole answer, once
    finished, is one call; while running nothing is sure yet."""

    name = "test"

    def split(self, content: str, final: bool) -> ToolCallSplit:
        return ToolCallSplit("", [ParsedCall("echo", json.dumps({"text": content}))] if final else [])


def test_llm_chat_renders_tools_and_parses_calls(llm, monkeypatch):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    out = llm.chat(messages, greedy, use_tqdm=False, tools=[WEATHER])[0]
    expected_prompt = TextPrompts(llm.get_tokenizer()).from_chat(messages, None, None, [WEATHER])
    assert (out.prompt, out.prompt_token_ids) == expected_prompt[:2] and '"get_weather"' in out.prompt
    assert out.outputs.tool_calls is None  # the random model wrote no call
    plain = llm.chat(messages, greedy, use_tqdm=False)[0]
    assert '"get_weather"' not in plain.prompt and plain.outputs.tool_calls is None
    with pytest.raises(TypeError, match="tools"):
        llm.chat(messages, greedy, use_tqdm=False, tools="get_weather")

    monkeypatch.setattr(llm.engine.output_processor, "tool_parser", _WholeAnswerIsACall())
    whole = llm.chat(messages, greedy, use_tqdm=False, tools=[WEATHER])[0].outputs
    assert whole.text == "" and [c["function"]["name"] for c in whole.tool_calls] == ["echo"]
    assert json.loads(whole.tool_calls[0]["function"]["arguments"]) == {"text": out.outputs.text}
    assert llm.chat(messages, greedy, use_tqdm=False)[0].outputs.tool_calls is None  # no tools: no parsing
    chunks = [c[0] for c in llm.chat(messages, greedy, use_tqdm=False, tools=[WEATHER], stream=True) if c[0]]
    text, _, calls = joined(chunks)
    assert text == "" and [c["function"] for c in calls] == [c["function"] for c in whole.tool_calls]
