"""FastDeploy's documented Python snippets, run verbatim (issue 16): every block of its docs/offline_inference.md
that uses the offline API, the multimodal one of docs/zh/offline_inference.md (which differs from the English
one), and the Python block of docs/parameters.md. Each is stored unchanged in tests/fixtures/fastdeploy_docs/
(header: upstream file and commit); the only changes are the substitutions listed next to each test, applied
with str.replace (each must match), and the snippet is exec'd as it stands. The checks read the variables the
snippet leaves behind."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from PIL import Image

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.request import CompletionOutput, RequestMetrics, RequestOutput

from conftest import FIXTURES, TINY_HF, serve_files
from test_api_server import MAX_MODEL_LEN, Server
from test_ernie45_vl_vision import gradient_image

DOCS = FIXTURES / "fastdeploy_docs"
MOE_PADDLE = FIXTURES / "models" / "ernie45_moe_tiny_paddle"  # stands in for ERNIE-4.5-21B-A3B-Base-Paddle
VL = FIXTURES / "models" / "ernie45_vl_tiny_hf"  # stands in for ERNIE-4.5-VL-28B-A3B-Paddle
IMAGE_TOKEN_ID = json.loads((VL / "config.json").read_text())["image_token_id"]
DOC_MEDIA_HOST = "https://paddlenlp.bj.bcebos.com"
DOC_IMAGE_PATH = "/datasets/paddlemix/demo_images/example2.jpg"
# Random-weight fixtures rarely write EOS: the documented max_tokens=6400 would run for ~40 s on the text
# snippets, so it is lowered there; a snippet without max_tokens gets a smaller max_model_len instead.
FEW_TOKENS = "max_tokens=48"


def run_snippet(name: str, substitutions: dict[str, str], **names: Any) -> dict[str, Any]:
    """Exec the stored snippet after the substitutions; its global variables. `names`: what the snippet
    assumes is already imported."""
    path = DOCS / name
    code = path.read_text(encoding="utf-8")
    for old, new in substitutions.items():
        assert old in code, f"{name} no longer contains {old!r}"
        code = code.replace(old, new)
    namespace: dict[str, Any] = {"__name__": "fastdeploy_doc_snippet", **names}
    exec(compile(code, str(path), "exec"), namespace)
    return namespace


def model(path: Path) -> str:
    return json.dumps(str(path))


def eos_ids(path: Path) -> set[int]:
    """The checkpoint's end-of-sequence ids, from its generation_config.json."""
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    return set(eos) if isinstance(eos, list) else {eos}


@pytest.fixture(scope="module")
def media_host():
    """The documented image URL's path, served on 127.0.0.1 (a small JPEG, as the page's example2.jpg)."""
    buffer = io.BytesIO()
    gradient_image(64, 48).save(buffer, format="JPEG")
    with serve_files({DOC_IMAGE_PATH: buffer.getvalue()}) as url:
        yield url


def check_completed(output, checkpoint: Path, room: int) -> None:
    """A finished output of FastDeploy's types: stopped by the checkpoint's EOS, or by length after `room`
    tokens; FastDeploy's metric meanings (durations from the right start points)."""
    out = output.outputs
    assert isinstance(output, RequestOutput) and isinstance(out, CompletionOutput)
    assert isinstance(output.metrics, RequestMetrics) and isinstance(out.text, str)
    assert output.finished and output.error_code == 200 and output.error_msg is None
    assert 1 <= len(out.token_ids) <= room
    if out.finish_reason == "length":
        assert len(out.token_ids) == room
    else:
        assert out.finish_reason == "stop" and out.token_ids[-1] in eos_ids(checkpoint)
    m = output.metrics
    assert m.arrival_time <= m.inference_start_time and 0 <= m.first_token_time <= m.model_forward_time
    assert m.model_execute_time >= m.model_forward_time + (m.inference_start_time - m.arrival_time) - 1e-6


# ---- docs/offline_inference.md --------------------------------------------------------------------------
def test_chat_interface():
    ns = run_snippet("offline_inference_chat.py", {'"ERNIE-4.5-0.3B"': model(TINY_HF), "max_tokens=6400": FEW_TOKENS})
    outputs, llm, messages = ns["outputs"], ns["llm"], ns["messages"]
    tokenizer = llm.get_tokenizer()
    assert len(outputs) == 2 and len({o.request_id for o in outputs}) == 2
    for output, conversation in zip(outputs, messages):  # in input order, each rendered by the chat template
        assert output.prompt == tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        assert all(m["content"] in output.prompt for m in conversation)
        assert output.prompt_token_ids == tokenizer.encode(output.prompt, add_special_tokens=False)
        check_completed(output, TINY_HF, 48)
        assert output.outputs.text == tokenizer.decode(output.outputs.token_ids, skip_special_tokens=True)
        assert output.outputs.reasoning_content is None  # no reasoning parser
    assert (ns["prompt"], ns["generated_text"]) == (outputs[-1].prompt, outputs[-1].outputs.text)


def test_reasoning_model_chat_with_an_image(media_host):
    # No max_tokens in this snippet: the output may run to max_model_len, so that is what gets smaller.
    ns = run_snippet("offline_inference_chat_vl_thinking.py", {
        '"baidu/ERNIE-4.5-VL-28B-A3B-Paddle"': model(VL), DOC_MEDIA_HOST: media_host,
        "max_model_len=32768": "max_model_len=96"})
    [output] = ns["outputs"]
    assert "图中的文物属于哪个年代" in output.prompt and output.prompt.endswith("</think>\n\n")
    assert output.num_input_image_tokens == output.prompt_token_ids.count(IMAGE_TOKEN_ID) > 0
    tokenizer = ns["llm"].get_tokenizer()
    check_completed(output, VL, 96 - len(output.prompt_token_ids))
    # enable_thinking=False: the parser takes the whole output as the answer.
    assert ns["reasoning_text"] == "" and output.outputs.reasoning_content == ""
    assert ns["generated_text"] == tokenizer.decode(output.outputs.token_ids, skip_special_tokens=True)


def test_text_completion_interface():
    ns = run_snippet("offline_inference_generate.py", {
        '"baidu/ERNIE-4.5-21B-A3B-Base-Paddle"': model(MOE_PADDLE), "max_tokens=6400": FEW_TOKENS})
    [output] = ns["outputs"]
    tokenizer = ns["llm"].get_tokenizer()
    assert output.prompt == ns["prompts"][0] == ns["prompt"]
    assert output.prompt_token_ids == tokenizer.encode(ns["prompts"][0])  # no template added
    check_completed(output, MOE_PADDLE, 48)
    assert ns["generated_text"] == tokenizer.decode(output.outputs.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("page", ["offline_inference_generate_vl.py", "zh_offline_inference_generate_vl.py"])
def test_multimodal_generate(media_host, page):
    ns = run_snippet(page, {'"baidu/ERNIE-4.5-VL-28B-A3B-Paddle"': model(VL), DOC_MEDIA_HOST: media_host,
                            "max_tokens=6400": FEW_TOKENS})
    [image] = ns["images"]
    assert isinstance(image, Image.Image) and image.size == (64, 48) and ns["videos"] == []
    [output] = ns["outputs"]
    llm, tokenizer = ns["llm"], ns["tokenizer"]
    # Both pages' prompts open the assistant's reply (the zh page relies on the default, as PaddleFormers').
    assert output.prompt == tokenizer.apply_chat_template(ns["messages"], tokenize=False, add_generation_prompt=True)
    assert output.prompt.endswith("Assistant: <think>\n\n</think>\n\n")  # the template's non-thinking default
    # The same conversation through llm.chat (which fetches the URL itself) gives the same model input.
    chat = llm.chat(ns["messages"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert chat.prompt_token_ids == output.prompt_token_ids
    assert output.num_input_image_tokens == chat.num_input_image_tokens == output.prompt_token_ids.count(
        IMAGE_TOKEN_ID) > 0
    check_completed(output, VL, 48)
    assert ns["reasoning_text"] == "" and ns["generated_text"] == llm.get_tokenizer().decode(
        output.outputs.token_ids, skip_special_tokens=True)


# ---- docs/parameters.md --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server():
    """Started with two keys the way parameters.md shows (--api-key repeated), the first the snippet's."""
    s = Server(str(TINY_HF), "--api-key", "your-api-key-here", "--api-key", "key2", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0


def test_api_key_client(keyed_server):
    ns = run_snippet("parameters_api_key_client.py", {"http://localhost:8000/v1": f"{keyed_server.url}/v1"},
                     OpenAI=openai.OpenAI)
    # The body of the page's curl example (bounded: max_tokens), greedy so LLM.chat is the reference.
    body = {"messages": [{"role": "user", "content": "你好"}], "stream": False, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": True}}
    reply = ns["client"].chat.completions.create(
        model="tiny", messages=body["messages"], stream=False, temperature=0, max_tokens=8,
        extra_body={k: body[k] for k in ("return_token_ids", "chat_template_kwargs")})
    ref = LLM(model=str(TINY_HF), max_model_len=MAX_MODEL_LEN).chat(
        body["messages"], SamplingParams(temperature=0, max_tokens=8), chat_template_kwargs={"enable_thinking": True},
        use_tqdm=False)[0]
    assert reply.choices[0].message.completion_token_ids == ref.outputs.token_ids
    assert reply.choices[0].message.content == ref.outputs.text
    url = f"{keyed_server.url}/v1"
    assert openai.OpenAI(api_key="key2", base_url=url, max_retries=0).models.list().data[0].id == "tiny"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="key3", base_url=url, max_retries=0).models.list()
