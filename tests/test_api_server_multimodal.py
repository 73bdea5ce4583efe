"""Images and videos through the OpenAI server on the tiny ERNIE-4.5-VL fixture, driven by the official
`openai` client: image_url parts (data: URL and http from a local server) give transformers' reference
tokens; a video_url part gives what LLM.chat gives in this process on the same mp4; bad media get a 400
naming the problem while the server keeps serving."""
import base64
import io
import json
from pathlib import Path

import httpx
import openai
import pytest

from fastdeploy import LLM, SamplingParams

from conftest import serve_files
from test_api_server import KEY, Server
from test_ernie45_vl_vision import gradient_image

ROOT = Path(__file__).resolve().parent.parent
VL = ROOT / "tests/fixtures/models/ernie45_vl_tiny_hf"
VIDEO = ROOT / "tests/fixtures/media/ernie45_vl_tiny.mp4"
CASE = next(c for c in json.loads((ROOT / "tests/fixtures/reference/ernie45_vl_tiny.json").read_text())["cases"]
            if c["name"] == "one_image")
MAX_MODEL_LEN = "1024"


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server sees the reference's pixels
    return buffer.getvalue()


def data_url(payload: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(payload).decode()}"


def image_messages(url: str) -> list[dict]:
    """The reference case's conversation with its image at `url`."""
    content = [{"type": "image_url", "image_url": {"url": url}} if p["type"] == "image_url" else p
               for p in CASE["messages"][0]["content"]]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def media_host():
    """A local http server: /image.png is the reference image, anything else 404."""
    with serve_files({"/image.png": png(gradient_image(64, 48))}) as url:
        yield url


@pytest.fixture(scope="module")
def server():
    s = Server(str(VL), "--api-key", KEY, "--max-model-len", MAX_MODEL_LEN, "--served-model-name", "vl",
               "--limit-mm-per-prompt", '{"image": 1}', "--dtype", "float32",  # transformers' float32 tokens
               "--allowed-media-domains", "127.0.0.1")  # the tests' own HTTP server
    yield s
    assert s.stop() == 0


def chat(server, messages, **kw):
    return server.client().chat.completions.create(
        model="vl", messages=messages, temperature=0, max_tokens=len(CASE["output_token_ids"]),
        extra_body={"return_token_ids": True, "chat_template_kwargs": CASE["chat_template_kwargs"]}, **kw)


@pytest.mark.parametrize("where", ["data", "http"])
def test_image_url_gives_the_reference_tokens(server, media_host, where):
    url = data_url(png(gradient_image(64, 48)), "image/png") if where == "data" else f"{media_host}/image.png"
    choice = chat(server, image_messages(url)).choices[0]
    assert choice.message.prompt_token_ids == CASE["input_ids"]
    assert choice.message.completion_token_ids == CASE["output_token_ids"]


def test_streamed_image_chat_joins_to_the_reference(server):
    stream = chat(server, image_messages(data_url(png(gradient_image(64, 48)), "image/png")), stream=True)
    tokens = [t for chunk in stream for c in chunk.choices for t in getattr(c.delta, "completion_token_ids", None) or []]
    assert tokens == CASE["output_token_ids"]


def test_video_url_equals_llm_chat():
    """The fixture mp4 as a data: URL through the server gives LLM.chat's tokens for the same file."""
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(VIDEO)}},
                                             {"type": "text", "text": "Describe the video."}]}]
    llm = LLM(model=str(VL), max_model_len=2048, use_warmup=0)  # the tiny mp4 is upscaled to ~1200 tokens
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert expected.num_input_video_tokens > 0 and expected.error_code == 200
    del llm
    s = Server(str(VL), "--api-key", KEY, "--max-model-len", "2048", "--served-model-name", "vl")
    try:
        messages[0]["content"][0]["video_url"]["url"] = data_url(VIDEO.read_bytes(), "video/mp4")
        out = s.client().chat.completions.create(model="vl", messages=messages, temperature=0, max_tokens=8,
                                                 extra_body={"return_token_ids": True})
        assert out.choices[0].message.completion_token_ids == expected.outputs.token_ids
        assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("url, message", [
    ("{host}/missing.png", "HTTP 404"),
    (data_url(b"not an image", "image/png"), "could not be decoded"),
    ("/no/such/file.png", "not allowed on this server"),  # local paths need --allowed-local-media-path
])
def test_bad_media_get_400_naming_the_problem(server, media_host, url, message):
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        chat(server, image_messages(url.format(host=media_host)))
    assert caught.value.body["param"] == "messages"


def test_limits_and_placeholders_without_media(server):
    two = image_messages(data_url(png(gradient_image(64, 48)), "image/png"))
    two[0]["content"].insert(0, two[0]["content"][0])
    with pytest.raises(openai.BadRequestError, match="limit_mm_per_prompt"):
        chat(server, two)
    with pytest.raises(openai.BadRequestError, match="placeholder"):  # completions cannot carry media
        server.client().completions.create(model="vl", prompt=CASE["input_ids"], max_tokens=2)
    r = httpx.get(f"{server.url}/health", timeout=10)
    assert r.status_code == 200  # none of it hurt the engine
    assert chat(server, image_messages(data_url(png(gradient_image(64, 48)), "image/png"))).choices[0].message.content \
        is not None


def test_image_parts_to_a_text_only_model_get_400(tiny_hf):
    s = Server(tiny_hf, "--api-key", KEY)
    try:
        with pytest.raises(openai.BadRequestError, match="multimodal model") as caught:
            s.client().chat.completions.create(model=tiny_hf, messages=image_messages("/x.png"), max_tokens=2)
        assert caught.value.body["param"] == "messages"
    finally:
        assert s.stop() == 0
