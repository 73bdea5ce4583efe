"""ERNIE-4.5-VL end to end through LLM.chat / LLM.generate on the tiny VL fixture: every reference case
(tests/fixtures/reference/ernie45_vl_tiny.json) gives transformers' 8 greedy tokens, through chat messages and
through `multimodal_data`, alone and batched, with a chunked prefill that cuts through the images, and with
prefix caching on two prompts that differ only in their image; limit_mm_per_prompt and the token counts."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.entrypoints.llm import LLM

from test_ernie45_vl_vision import IMAGES, checker_image, gradient_image, video_frames

VL = Path(__file__).resolve().parent / "fixtures" / "models" / "ernie45_vl_tiny_hf"
REF = json.loads((VL.parent.parent / "reference" / "ernie45_vl_tiny.json").read_text())
CASES = REF["cases"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
VIDEO = {"one_video": lambda: [video_frames(4, 532, 448)], "image_and_video": lambda: [video_frames(4, 532, 448)]}


def media(case: dict) -> tuple[list, list]:
    images = IMAGES[case["name"]]() if case["name"] in IMAGES else []
    return images, VIDEO[case["name"]]() if case["name"] in VIDEO else []


def messages(case: dict) -> list[dict]:
    """The case's messages with the synthetic media put in their content parts."""
    images, videos = (iter(m) for m in media(case))
    out = []
    for message in case["messages"]:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": next(images)}} if p.get("type") == "image_url"
                       else {"type": "video", "video": next(videos)} if p.get("type") == "video_url"
                       else p for p in content]
        out.append({**message, "content": content})
    return out


def generate_prompt(case: dict) -> dict | str:
    images, videos = media(case)
    if not images and not videos:
        return case["prompt"]
    return {"prompt": case["prompt"], "multimodal_data": {"image": images, "video": videos}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(VL), max_model_len=1024, num_gpu_blocks_override=256, use_warmup=0, dtype="float32")


@pytest.fixture(scope="module")
def chunked() -> LLM:
    return LLM(model=str(VL), max_model_len=1024, num_gpu_blocks_override=256, use_warmup=0, dtype="float32",
               enable_chunked_prefill=True, max_num_batched_tokens=14, enable_prefix_caching=True, block_size=8,
               limit_mm_per_prompt={"image": 1})


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_chat_gives_the_reference_tokens(llm, case):
    out = llm.chat(messages(case), GREEDY, use_tqdm=False, chat_template_kwargs=case.get("chat_template_kwargs"))[0]
    assert out.prompt_token_ids == case["input_ids"]
    assert out.outputs.token_ids == case["output_token_ids"]
    tokens = llm.config.model_config.multimodal.tokens
    ids = np.asarray(case["input_ids"])
    types = np.asarray(case["moe_mm_token_type_ids"])
    assert out.num_input_image_tokens == int(((ids == tokens.image) & (types == 1)).sum())
    assert out.num_input_video_tokens == int(((ids == tokens.video) & (types == 2)).sum())


def test_generate_with_multimodal_data_batched_equals_the_reference(llm):
    outs = llm.generate([generate_prompt(c) for c in CASES], GREEDY, use_tqdm=False)
    for case, out in zip(CASES, outs):
        assert out.prompt_token_ids == case["input_ids"], case["name"]
        assert out.outputs.token_ids == case["output_token_ids"], case["name"]


def test_chunked_prefill_through_images_and_prefix_caching_per_image(chunked):
    """A 14-token budget cuts one_image's image after 2 of its 4 rows (placeholders at 12..15) and the video
    many times; two prompts alike but for their image share no block (each gives its own reference tokens);
    the same image again hits the cache."""
    cases = [c for c in CASES if c["name"] in ("one_image", "one_video", "text_only")]
    outs = chunked.generate([generate_prompt(c) for c in cases], GREEDY, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs.token_ids == case["output_token_ids"], case["name"]
    one = next(c for c in CASES if c["name"] == "one_image")
    other = {"prompt": one["prompt"], "multimodal_data": {"image": [checker_image(64, 48, 12)]}}
    alone = LLM(model=str(VL), max_model_len=1024, num_gpu_blocks_override=64, use_warmup=0, dtype="float32")
    expected = alone.generate(other, GREEDY, use_tqdm=False)[0].outputs.token_ids
    assert expected != one["output_token_ids"]
    got = chunked.generate(other, GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0 and got.outputs.token_ids == expected
    again = chunked.generate(generate_prompt(one), GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs.token_ids == one["output_token_ids"]


def test_limit_mm_per_prompt_and_placeholders_must_match_the_media(llm, chunked):
    two = next(c for c in CASES if c["name"] == "two_images")
    out = chunked.chat(messages(two), GREEDY, use_tqdm=False)[0]
    assert out.error_code == 400 and "limit_mm_per_prompt" in out.error_msg
    out = llm.generate({"prompt": "no placeholder", "multimodal_data": {"image": [gradient_image(64, 48)]}},
                       GREEDY, use_tqdm=False)[0]
    assert out.error_code == 400 and "placeholders" in out.error_msg


def test_the_documented_generate_example_with_ernie_bot_tokenizer(llm):
    """FastDeploy's example: ErnieBotTokenizer renders the prompt, generate takes it with multimodal_data."""
    from fastdeploy.input.ernie4_5_tokenizer import Ernie4_5Tokenizer
    from fastdeploy.input.ernie_tokenizer import ErnieBotTokenizer

    assert Ernie4_5Tokenizer is ErnieBotTokenizer
    case = next(c for c in CASES if c["name"] == "image_and_video")
    tokenizer = ErnieBotTokenizer.from_pretrained(str(VL))
    prompt = tokenizer.apply_chat_template(case["messages"], tokenize=False, **case.get("chat_template_kwargs", {}))
    assert prompt == case["prompt"]
    images, videos = media(case)
    out = llm.generate(prompts={"prompt": prompt, "multimodal_data": {"image": images, "video": videos}},
                       sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.outputs.token_ids == case["output_token_ids"]


def test_reasoning_parser_ernie_45_vl(tmp_path):
    """reasoning_parser="ernie-45-vl" on an image chat: thinking off puts the whole text in the answer."""
    vl = LLM(model=str(VL), max_model_len=256, num_gpu_blocks_override=32, use_warmup=0, dtype="float32",
             enable_mm=True, reasoning_parser="ernie-45-vl")
    case = next(c for c in CASES if c["name"] == "one_image")
    out = vl.chat(messages(case), GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.outputs.token_ids == case["output_token_ids"]
    assert out.outputs.reasoning_content in ("", None) and out.outputs.text == vl.get_tokenizer().decode(
        case["output_token_ids"])


def test_media_are_encoded_once_per_request_across_chunks(chunked, monkeypatch):
    """image_and_video prefilled in 14-token chunks beside text: one encode_vision call, and the runner keeps
    no rows once the request is done."""
    case = next(c for c in CASES if c["name"] == "image_and_video")
    runner = chunked.engine.runner
    calls = []
    encode = runner.model.encode_vision
    monkeypatch.setattr(runner.model, "encode_vision", lambda *a: calls.append(1) or encode(*a))
    text = next(c for c in CASES if c["name"] == "text_only")
    outs = chunked.generate([generate_prompt(case), generate_prompt(text)], GREEDY, use_tqdm=False)
    assert [o.outputs.token_ids for o in outs] == [case["output_token_ids"], text["output_token_ids"]]
    assert len(calls) == 1 and not runner.vision.encoded


def test_mm_processor_kwargs(llm):
    """image_max_pixels shrinks the image's tokens; unknown keys are refused by name."""
    from fastdeploy.model_executor.models.ernie4_5_vl.processor import MediaProcessor

    small = LLM(model=str(VL), max_model_len=512, num_gpu_blocks_override=64, use_warmup=0, dtype="float32",
                mm_processor_kwargs={"image_max_pixels": 56 * 56})
    big = {"prompt": "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>", "multimodal_data": {
        "image": [gradient_image(280, 280)]}}
    out = small.generate(big, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.num_input_image_tokens == 4  # 56x56 pixels: 4x4 patches, 2x2 merged
    assert llm.generate(big, SamplingParams(max_tokens=1), use_tqdm=False)[0].num_input_image_tokens == 100
    with pytest.raises(NotImplementedError, match="image_resample"):
        MediaProcessor.from_pretrained(VL, None, {"image_resample": 3})


def test_bad_media_fail_only_their_own_request(llm, tmp_path):
    """Unreadable, undecodable or miscounted media give that prompt's output error_code 400 and a message
    naming the problem; the other prompts of the call give the reference tokens."""
    case = next(c for c in CASES if c["name"] == "one_image")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    bad_sources = {str(tmp_path / "missing.png"): "could not read", str(tmp_path / "bad.png"): "could not be decoded"}
    prompts = [generate_prompt(case)]
    prompts += [{"prompt": case["prompt"], "multimodal_data": {"image": [source]}} for source in bad_sources]
    prompts.append({"prompt": case["prompt"], "multimodal_data": {"image": [gradient_image(64, 48)] * 2}})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[0].error_code == 200 and outs[0].outputs.token_ids == case["output_token_ids"]
    for out, message in zip(outs[1:], [*bad_sources.values(), "2 images"]):
        assert out.error_code == 400 and message in out.error_msg and out.outputs.token_ids == []
    conversation = messages(case)
    broken = [{**conversation[0], "content": [{"type": "image_url", "image_url": {"url": str(tmp_path / "bad.png")}},
                                              *conversation[0]["content"][1:]]}]
    outs = llm.chat([broken, conversation], GREEDY, use_tqdm=False,
                    chat_template_kwargs=case.get("chat_template_kwargs"))
    assert outs[0].error_code == 400 and "could not be decoded" in outs[0].error_msg
    assert outs[1].outputs.token_ids == case["output_token_ids"]


def test_baidu_placeholders_and_the_image_part_form(llm):
    """Baidu's `<|image@placeholder|>` / `<|video@placeholder|>` expand like the template's placeholders, and
    {"type": "image", "image": ...} / {"type": "video", "video": ...} parts work as image_url / video_url."""
    case = next(c for c in CASES if c["name"] == "image_and_video")
    images, videos = media(case)
    baidu = case["prompt"].replace("<|IMAGE_PLACEHOLDER|>", "<|image@placeholder|>").replace(
        "<|VIDEO_PLACEHOLDER|>", "<|video@placeholder|>")
    out = llm.generate({"prompt": baidu, "multimodal_data": {"image": images, "video": videos}}, GREEDY,
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == case["input_ids"] and out.outputs.token_ids == case["output_token_ids"]
    parts = [{"type": "image", "image": images[0]} if p.get("type") == "image_url" else p
             for p in messages(case)[0]["content"]]
    out = llm.chat([{**case["messages"][0], "content": parts}], GREEDY, use_tqdm=False,
                   chat_template_kwargs=case.get("chat_template_kwargs"))[0]
    assert out.prompt_token_ids == case["input_ids"] and out.outputs.token_ids == case["output_token_ids"]


@pytest.fixture(scope="module")
def uncached() -> LLM:
    return LLM(model=str(VL), max_model_len=1024, num_gpu_blocks_override=256, use_warmup=0, dtype="float32",
               enable_chunked_prefill=True, max_num_batched_tokens=14, enable_prefix_caching=False)


@pytest.mark.parametrize("preempt_after", [5, 50])
def test_preempted_media_request_recomputes_to_the_reference(uncached, preempt_after):
    """image_and_video preempted mid-prefill (step 5: inside the video) or after it started decoding (step
    50): its rows are re-encoded, prompt and generated tokens recomputed with the same positions."""
    case = next(c for c in CASES if c["name"] == "image_and_video")
    engine = uncached.engine
    text, ids, mm = uncached._prompts.from_prompt(generate_prompt(case))
    request = engine.make_requests(text, ids, GREEDY, 0, 0.0, mm=mm)[0]
    engine.add_request(request)
    steps = 0
    while not request.is_finished:
        engine.step()
        steps += 1
        if steps == preempt_after:
            assert (request.num_output_tokens > 0) == (preempt_after == 50)
            engine.scheduler._preempt(request)
    assert request.output_token_ids == case["output_token_ids"]
    engine.output_processor.release(request.request_id)


def test_placeholder_token_ids_without_media_are_refused(llm):
    case = next(c for c in CASES if c["name"] == "one_image")
    out = llm.generate([{"prompt_token_ids": case["input_ids"]}], GREEDY, use_tqdm=False)[0]
    assert out.error_code == 400 and "no media" in out.error_msg


def test_ngram_drafts_keep_the_reference_tokens(llm, monkeypatch):
    """Speculative decoding with media: drafts (the reference continuation, some tokens changed) verified after
    the images and videos give transformers' tokens; their positions are text positions after the prompt."""
    from test_speculative import use_oracle

    expected = llm.generate([generate_prompt(c) for c in CASES], GREEDY, use_tqdm=False)
    use_oracle(monkeypatch, expected, 4)
    drafting = LLM(model=str(VL), max_model_len=1024, num_gpu_blocks_override=256, use_warmup=0, dtype="float32",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = drafting.generate([generate_prompt(c) for c in CASES], GREEDY, use_tqdm=False)
    for case, out in zip(CASES, outs):
        assert out.outputs.token_ids == case["output_token_ids"], case["name"]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > len(CASES)
