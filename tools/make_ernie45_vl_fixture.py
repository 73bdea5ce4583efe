"""Build the tiny random ERNIE-4.5-VL checkpoint and record transformers' reference outputs for it.

    /work/refenv/bin/python tools/make_ernie45_vl_fixture.py      # ~15 s

Needs the reference venv (torch, transformers 5 with `models/ernie4_5_vl_moe`, torchvision, pillow,
av, safetensors, sentencepiece), never the project's test suite. Writes

  tests/fixtures/models/ernie45_vl_tiny_hf/   Ernie4_5_VLMoeForConditionalGeneration, random, seeded:
      config.json (transformers' nested `ernie4_5_vl_moe` layout), generation_config.json,
      model.safetensors written by `save_pretrained` in the hub `-PT` layout (separate q/k/v, routers
      `mlp.gate.weight` / `mlp.gate.weight_1` as [hidden, experts], one [2, experts] correction-bias
      row pair, experts 0..E-1 text and E..2E-1 vision, `vision_model.*`, `resampler_model.*` with
      `spatial_linear.0/2/3`); BF16 except the routers and correction biases (F32, as transformers
      keeps them). preprocessor_config.json / video_preprocessor_config.json (transformers' ERNIE-VL
      image and video processors, defaults except `draw_on_frames: false`: the Roboto font the
      real repos draw timestamps with is not available offline). Tokenizer: the ernie_sp fixture
      (sentencepiece, ids 0..1023) plus five added tokens <|IMAGE_START|> 1024, <|IMAGE_END|> 1025,
      <|VIDEO_START|> 1026, <|VIDEO_END|> 1027, <|VIDEO_PLACEHOLDER|> 1028 (<|IMAGE_PLACEHOLDER|> is
      ernie_sp's 1018), so every vision token id is >= the image placeholder id as in the real
      vocabulary; the chat template is CHAT_TEMPLATE below.
  tests/fixtures/media/ernie45_vl_tiny.mp4    8 frames 64x48 at 4 fps (h264), for the decode path.
  tests/fixtures/reference/ernie45_vl_tiny.json

Shape: the real ERNIE-4.5-VL-28B-A3B layout shrunk: text hidden 64, 4 heads / 2 KV heads of 16,
3 decoder layers (layer 0 dense, 1-2 MoE), 8 text + 8 vision experts, top-3, expert FFN 48 (text) /
16 (vision), 2 shared experts (FFN 96), vocab 1029; vision tower depth 2, width 32, 2 heads, real
patch 14 / spatial merge 2 / temporal merge 2; mrope_section [3, 3, 2] (the real [22, 22, 20] for
64 frequencies, scaled to 8) and rope_theta 100 instead of 500000, so that the few low frequencies
that carry t turn noticeably at the fixture's short positions.

The reference runs in float32 on the bf16-rounded weights, eager attention, and greedy decodes
NEW_TOKENS tokens recomputing the whole sequence each step (no KV cache; checked against
`generate` with the cache). Per case it stores the rendered prompt, input ids, both token-type rows,
the 3-D position ids and rope delta, the processor outputs (grids, pixel summaries), the vision
tower's and resampler's output summaries, the prefill's top-20 logits and per-step top-5 logprobs.
Images and video frames are integer formulas (`gradient_image`, `checker_image`, `video_frames`)
that tests can rebuild; their uint8 sha256 is recorded.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration, GenerationConfig
from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
    Ernie4_5_VLMoeImageProcessorPil,
)
from transformers.models.ernie4_5_vl_moe.processing_ernie4_5_vl_moe import Ernie4_5_VLMoeProcessor
from transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe import Ernie4_5_VLMoeVideoProcessor
from transformers.video_utils import VideoMetadata, load_video

from make_tokenizer_reference import ErnieReferenceTokenizer  # tools/, beside this script

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "tests" / "fixtures" / "models" / "ernie45_vl_tiny_hf"
TOKENIZER_SRC = ROOT / "tests" / "fixtures" / "tokenizers" / "ernie_sp"
MEDIA_DIR = ROOT / "tests" / "fixtures" / "media"
VIDEO_FILE = MEDIA_DIR / "ernie45_vl_tiny.mp4"
REFERENCE = ROOT / "tests" / "fixtures" / "reference" / "ernie45_vl_tiny.json"

SEED = 20251123
NEW_TOKENS = 8
TOP_STEP, TOP_PREFILL, SAMPLES = 5, 20, 64
EMBED_STD, PROJ_STD, ROUTER_STD, CORRECTION_BIAS_STD = 0.4, 0.4, 0.15, 0.05

IMAGE_TOKEN, AUDIO_TOKEN = "<|IMAGE_PLACEHOLDER|>", "<|AUDIO_PLACEHOLDER|>"
VL_TOKENS = {  # appended after ernie_sp's 1024 ids, in the real vocabulary's order
    "image_start_token": "<|IMAGE_START|>", "image_end_token": "<|IMAGE_END|>",
    "video_start_token": "<|VIDEO_START|>", "video_end_token": "<|VIDEO_END|>",
    "video_token": "<|VIDEO_PLACEHOLDER|>",
}
NAMED_TOKENS = {"image_token": IMAGE_TOKEN, **VL_TOKENS}

# The ERNIE-4.5-VL conversation format as transformers' conversion script writes it
# (DEFAULT_CHAT_TEMPLATE in src/transformers/models/ernie4_5_vl_moe/convert_ernie4_5_vl_moe_to_hf.py),
# rewritten here. Two spots of that template are taken from the original Baidu format instead: a
# system message ends with one '\n' (the script's string literal holds a newline plus indentation) and
# an assistant turn closes with '<|end_of_sentence|>' (the script has '<|end_of_sentence |>').
# Images/videos render as `Picture N:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>` /
# `Video N:<|VIDEO_START|><|VIDEO_PLACEHOLDER|><|VIDEO_END|>`, the processor then repeats the
# placeholder once per merged patch. The original Baidu template writes `<|image@placeholder|>` /
# `<|video@placeholder|>` there instead (FastDeploy's processor expands those).
CHAT_TEMPLATE = (
    "{%- set counter = namespace(image=0, video=0) -%}\n"
    "{%- macro text_of(content) -%}\n"
    "    {%- if content is string -%}{{- content -}}\n"
    "    {%- elif content is iterable and content is not mapping -%}\n"
    "        {%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}\n"
    "    {%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{{- '<|begin_of_sentence|>' -}}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message.role in ['system', 'user'] -%}\n"
    "        {%- if message.role == 'user' -%}{{- 'User: ' -}}{%- endif -%}\n"
    "        {%- if message.content is string -%}\n"
    "            {{- message.content -}}\n"
    "        {%- else -%}\n"
    "            {%- for part in message.content -%}\n"
    "                {%- if part.type == 'text' -%}\n"
    "                    {{- part.text -}}\n"
    "                {%- elif part.type in ['image_url', 'image'] -%}\n"
    "                    {%- set counter.image = counter.image + 1 -%}\n"
    "                    {{- 'Picture ' ~ counter.image ~ ':<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>' -}}\n"
    "                {%- elif part.type in ['video_url', 'video'] -%}\n"
    "                    {%- set counter.video = counter.video + 1 -%}\n"
    "                    {{- 'Video ' ~ counter.video ~ ':<|VIDEO_START|><|VIDEO_PLACEHOLDER|><|VIDEO_END|>' -}}\n"
    "                {%- endif -%}\n"
    "            {%- endfor -%}\n"
    "        {%- endif -%}\n"
    "        {%- if message.role == 'system' -%}{{- '\\n' -}}{%- endif -%}\n"
    "    {%- elif message.role == 'assistant' -%}\n"
    "        {%- set reasoning = text_of(message.reasoning_content) -%}\n"
    "        {%- set content = text_of(message.content) -%}\n"
    "        {%- if '</think>' in content -%}\n"
    "            {%- set reasoning = content.split('</think>')[0].rstrip('\\n') -%}\n"
    "            {%- set reasoning = reasoning.split('<think>')[-1].lstrip('\\n') -%}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}\n"
    "        {%- endif -%}\n"
    "        {%- if reasoning -%}\n"
    "            {{- '\\nAssistant: <think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}\n"
    "            {{- content.lstrip('\\n') -}}\n"
    "        {%- else -%}\n"
    "            {{- '\\nAssistant: ' + content -}}\n"
    "        {%- endif -%}\n"
    "        {{- '<|end_of_sentence|>' -}}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt is not defined or add_generation_prompt is true -%}\n"
    "    {{- '\\nAssistant: ' -}}\n"
    "    {%- if enable_thinking is not defined or enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}\n"
    "    {%- elif enable_thinking is true -%}{{- '<think>' -}}\n"
    "    {%- endif -%}\n"
    "{%- endif -%}"
)

# The other ERNIE fixtures' generation_config.json (shaped like ERNIE-4.5-0.3B's); the VL repos' own
# values were not available offline.
GENERATION_CONFIG = {
    "do_sample": True, "top_p": 0.8, "temperature": 0.8, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


# ----------------------------------------------------------------------------------------- config
def build_config(vocab_size: int, token_ids: dict[str, int]) -> Ernie4_5_VLMoeConfig:
    text = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "use_bias": False, "tie_word_embeddings": True,
        "moe_num_experts": 8, "moe_k": 3, "moe_intermediate_size": [48, 16], "moe_num_shared_experts": 2,
        "moe_norm_min": 1e-12, "mlp_layer_types": ["dense", "sparse", "sparse"],
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [3, 3, 2]},
    }
    vision = {
        "depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 128, "hidden_act": "quick_gelu",
        "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_merge_size": 2, "rms_norm_eps": 1e-6,
    }
    config = Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **token_ids)
    config.architectures = ["Ernie4_5_VLMoeForConditionalGeneration"]
    return config


# ---------------------------------------------------------------------------------------- weights
def bf16_round(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


def is_router(name: str) -> bool:
    return ".gate.weight" in name or "moe_statics" in name


def draw_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random tensor for parameter `name` (transformers' in-memory name)."""
    normal = lambda std, mean=0.0: (rng.standard_normal(shape) * std + mean).astype(np.float32)  # noqa: E731
    if "moe_statics" in name:
        return normal(CORRECTION_BIAS_STD)
    if ".gate.weight" in name:
        return normal(ROUTER_STD)
    if "language_model.embed_tokens" in name:
        return normal(EMBED_STD)
    if name.startswith("model.language_model."):
        return normal(0.1, 1.0) if name.endswith("norm.weight") else normal(PROJ_STD)
    # vision tower and resampler: fan-in scaled, so activations stay O(1)
    if name.endswith("norm.weight") or name.endswith("ln.weight") or name.endswith(("norm1.weight", "norm2.weight")):
        return normal(0.1, 1.0)
    if name.endswith(".bias"):
        return normal(0.1)
    return normal(1.0 / np.sqrt(shape[-1]))


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded draws, bf16-representable except the routers."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = draw_value(name, tuple(param.shape), rng)
            param.copy_(torch.from_numpy(value if is_router(name) else bf16_round(value)))


def save_checkpoint(model: Ernie4_5_VLMoeForConditionalGeneration, out: Path) -> None:
    """save_pretrained in the hub layout; BF16 except routers / correction biases (F32)."""
    state = {name: (p.detach().clone() if is_router(name) else p.detach().to(torch.bfloat16))
             for name, p in model.state_dict().items() if name != "lm_head.weight"}
    model.save_pretrained(out, state_dict=state, safe_serialization=True)


def check_reload(model: torch.nn.Module, out: Path) -> Ernie4_5_VLMoeForConditionalGeneration:
    reloaded, info = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"reload of {out} is not clean: {problems}"
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), f"{name} changed through save/load"
    return reloaded.eval()


# -------------------------------------------------------------------------------------- tokenizer
def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer(out: Path) -> None:
    """ernie_sp + the VL added tokens + the VL chat template."""
    shutil.copy2(TOKENIZER_SRC / "tokenizer.model", out / "tokenizer.model")
    added = read_json(TOKENIZER_SRC / "added_tokens.json")
    first = 1 + max(added.values())
    added.update({token: first + i for i, token in enumerate(VL_TOKENS.values())})
    write_json(out / "added_tokens.json", added)
    special = read_json(TOKENIZER_SRC / "special_tokens_map.json")
    special["additional_special_tokens"] = list(added)
    write_json(out / "special_tokens_map.json", special)
    config = read_json(TOKENIZER_SRC / "tokenizer_config.json")
    config.update(NAMED_TOKENS)  # as transformers' converted tokenizers name them (`tokenizer.image_token`)
    config["chat_template"] = CHAT_TEMPLATE
    write_json(out / "tokenizer_config.json", config)


def load_tokenizer(out: Path) -> ErnieReferenceTokenizer:
    none = dict.fromkeys(["sys_start_token", "sys_end_token", "header_start_token", "header_end_token"])
    tokenizer = ErnieReferenceTokenizer.from_pretrained(str(out), extra_special_tokens=NAMED_TOKENS, **none)
    extras = read_json(out / "special_tokens_map.json")["additional_special_tokens"]
    missing = [t for t in extras if t not in tokenizer.all_special_tokens]
    assert not missing, f"special tokens not registered: {missing}"
    return tokenizer


def write_processor_configs(processor: Ernie4_5_VLMoeProcessor, out: Path) -> None:
    processor.image_processor.save_pretrained(out)
    processor.video_processor.save_pretrained(out)
    reloaded = Ernie4_5_VLMoeImageProcessorPil.from_pretrained(out)
    assert reloaded.to_dict() == processor.image_processor.to_dict()
    reloaded_video = Ernie4_5_VLMoeVideoProcessor.from_pretrained(out)
    assert reloaded_video.to_dict() == processor.video_processor.to_dict()


# ------------------------------------------------------------------------------------------ media
def gradient_image(width: int, height: int) -> Image.Image:
    """R = 4x mod 256, G = 5y mod 256, B = (x + y) * 3 mod 256 (x, y from the top left)."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(4 * x) % 256, (5 * y) % 256, ((x + y) * 3) % 256], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def checker_image(width: int, height: int, cell: int) -> Image.Image:
    """cell x cell squares: (230, 40, 40) where (x // cell + y // cell) is even, else (20, 60, 200 - y % 64)."""
    y, x = np.mgrid[0:height, 0:width]
    even = ((x // cell + y // cell) % 2 == 0)[..., None]
    other = np.stack([np.full_like(y, 20), np.full_like(y, 60), 200 - y % 64], axis=-1)
    rgb = np.where(even, np.array([230, 40, 40]), other)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def video_frames(count: int, width: int, height: int) -> np.ndarray:
    """[count, height, width, 3] uint8: frame t is R = (2x + 16t) mod 256, G = (3y) mod 256,
    B = 255 inside a 40-pixel square whose corner moves 24 pixels right per frame, else 30."""
    t, y, x = np.mgrid[0:count, 0:height, 0:width]
    box = (x >= 24 * t + 10) & (x < 24 * t + 50) & (y >= 100) & (y < 140)
    rgb = np.stack([(2 * x + 16 * t) % 256, (3 * y) % 256, np.where(box, 255, 30)], axis=-1)
    return rgb.astype(np.uint8)


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "preset": "veryfast", "threads": "1", "bframes": "0"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


# ---------------------------------------------------------------------------------------- summary
def summary(array: Any, seed: int = 0, head: int = 16) -> dict[str, Any]:
    """Shape, sums, mean/std, the first `head` values and SAMPLES values at seeded positions."""
    a = np.asarray(array, dtype=np.float64)
    flat = a.reshape(-1)
    picks = np.random.default_rng(seed).integers(0, flat.size, SAMPLES)
    return {"shape": list(a.shape), "sum": float(flat.sum()), "abs_sum": float(np.abs(flat).sum()),
            "mean": float(flat.mean()), "std": float(flat.std()), "head": flat[:head].tolist(),
            "positions": picks.tolist(), "values": flat[picks].tolist()}


def as_list(x: Any) -> Any:
    return x.tolist() if hasattr(x, "tolist") else x


# ----------------------------------------------------------------------------------------- cases
def image_processor_record(processor: Ernie4_5_VLMoeImageProcessorPil, image: Image.Image, seed: int) -> dict:
    out = processor(images=[image], return_tensors="np")
    grid = out["image_grid_thw"][0].tolist()
    patch = processor.patch_size
    return {"width": image.width, "height": image.height, "rgb_sha256": sha256(np.asarray(image)),
            "resized_hw": [grid[1] * patch, grid[2] * patch], "grid_thw": grid,
            "pixel_values": summary(out["pixel_values"], seed)}


def routing_hooks(model: torch.nn.Module, sink: dict[str, list]) -> list[Any]:
    """Forward hooks on every router recording, per call, the smallest gap between the k-th and (k+1)-th
    biased score (how far the top-k choice is from a tie) and how many tokens' expert sets the
    correction bias changed."""
    handles = []
    for module in model.modules():
        if type(module).__name__ != "Ernie4_5_VLMoeMoeTopKRouter":
            continue

        def hook(mod: torch.nn.Module, args: tuple, _out: Any) -> None:
            if not args[0].shape[0]:
                return
            scores = torch.softmax(torch.nn.functional.linear(args[0].float(), mod.weight.float()), dim=-1)
            biased = scores + mod.moe_statics.e_score_correction_bias.squeeze()
            ordered = biased.sort(dim=-1, descending=True).values
            sink["margins"].append(float((ordered[:, mod.top_k - 1] - ordered[:, mod.top_k]).min()))
            plain = scores.topk(mod.top_k).indices.sort(dim=-1).values
            chosen = biased.topk(mod.top_k).indices.sort(dim=-1).values
            sink["bias_changed"].append(int((plain != chosen).any(dim=-1).sum()))
            sink["choices"].append(int(scores.shape[0]))
        handles.append(module.register_forward_hook(hook))
    return handles


def extend_inputs(inputs: dict[str, torch.Tensor], token: int) -> dict[str, torch.Tensor]:
    """Append a generated (text) token: id, type 0 in both token-type rows, attention 1."""
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[token]])], dim=1)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    for key in ("mm_token_type_ids", "moe_mm_token_type_ids"):
        if key in inputs:
            out[key] = torch.cat([inputs[key], torch.zeros((1, 1), dtype=inputs[key].dtype)], dim=1)
    return out


def top(logprobs: torch.Tensor, k: int) -> list[list[float]]:
    values, ids = logprobs.topk(k)
    return [[int(i), float(v)] for i, v in zip(ids, values)]


def greedy(model: Ernie4_5_VLMoeForConditionalGeneration, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """NEW_TOKENS greedy steps, the whole sequence recomputed each step (rope_deltas reset)."""
    steps, prefill, gaps = [], None, []
    current = inputs
    for step in range(NEW_TOKENS):
        model.model.rope_deltas = None
        with torch.no_grad():
            logits = model(**current).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        two = logits.topk(2).values
        gaps.append(float(two[0] - two[1]))
        if step == 0:
            values, ids = logits.topk(TOP_PREFILL)
            prefill = {"top20_logits": [[int(i), float(v)] for i, v in zip(ids, values)],
                       "top20_logprobs": top(logprobs, TOP_PREFILL),
                       "logsumexp": float(torch.logsumexp(logits, dim=-1))}
        token = int(logits.argmax())
        steps.append({"token": token, "logprob": float(logprobs[token]), "top5": top(logprobs, TOP_STEP)})
        current = extend_inputs(current, token)
    return {"output_token_ids": [s["token"] for s in steps], "steps": steps, "prefill": prefill,
            "min_top2_logit_gap": min(gaps)}


def check_with_cache(model: Ernie4_5_VLMoeForConditionalGeneration, inputs: dict[str, torch.Tensor],
                     expected: list[int]) -> None:
    model.model.rope_deltas = None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             generation_config=GenerationConfig(eos_token_id=None, pad_token_id=0))
    got = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert got == expected, f"generate with KV cache gave {got}, full recompute {expected}"


def vision_record(model: Ernie4_5_VLMoeForConditionalGeneration, inputs: dict[str, torch.Tensor]) -> dict:
    record = {}
    with torch.no_grad():
        for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                                   ("video", "pixel_values_videos", "video_grid_thw")):
            if pixels not in inputs:
                continue
            tower = model.model.vision_tower(inputs[pixels], inputs[grid]).last_hidden_state
            merged = model.model.resampler_model(tower, inputs[grid])
            record[kind] = {"vision_tower_output": summary(tower.numpy(), 1),
                            "resampler_output": summary(merged.numpy(), 2),
                            "resampler_output_first_row": merged[0, :16].tolist(),
                            "resampler_output_last_row": merged[-1, :16].tolist()}
    return record


def processor_inputs(processor: Ernie4_5_VLMoeProcessor, messages: list[dict], images: list[Image.Image],
                     videos: list[np.ndarray], template_kwargs: dict[str, Any]) -> tuple[str, dict]:
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    kwargs: dict[str, Any] = {"text": [prompt], "return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
        kwargs["do_sample_frames"] = False
    return prompt, dict(processor(**kwargs))


def run_case(name: str, model: Ernie4_5_VLMoeForConditionalGeneration, processor: Ernie4_5_VLMoeProcessor,
             messages: list[dict], images: list[Image.Image], videos: list[np.ndarray],
             template_kwargs: dict[str, Any]) -> dict[str, Any]:
    prompt, inputs = processor_inputs(processor, messages, images, videos, template_kwargs)
    ids = inputs["input_ids"]
    record: dict[str, Any] = {"name": name, "messages": messages, "chat_template_kwargs": template_kwargs,
                              "prompt": prompt, "rendered_prompt_tokens_text": processor.tokenizer.decode(ids[0]),
                              "input_ids": ids[0].tolist(), "num_prompt_tokens": ids.shape[1]}
    for key in ("mm_token_type_ids", "moe_mm_token_type_ids"):
        record[key] = inputs[key][0].tolist()
    if "image_grid_thw" in inputs or "video_grid_thw" in inputs:
        positions, deltas = model.model.get_rope_index(
            ids, inputs["mm_token_type_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
            attention_mask=inputs["attention_mask"])
        record["position_ids"] = positions[:, 0].tolist()
        record["rope_delta"] = int(deltas[0, 0])
    else:
        record["position_ids"] = [list(range(ids.shape[1]))] * 3
        record["rope_delta"] = 0
    if "pixel_values" in inputs:
        record["image_grid_thw"] = inputs["image_grid_thw"].tolist()
        record["pixel_values"] = summary(inputs["pixel_values"].numpy(), 3)
        record["images"] = [{"width": im.width, "height": im.height, "rgb_sha256": sha256(np.asarray(im))}
                            for im in images]
    if "pixel_values_videos" in inputs:
        record["video_grid_thw"] = inputs["video_grid_thw"].tolist()
        record["pixel_values_videos"] = summary(inputs["pixel_values_videos"].numpy(), 4)
        record["videos"] = [{"frames": int(v.shape[0]), "height": int(v.shape[1]), "width": int(v.shape[2]),
                             "rgb_sha256": sha256(v)} for v in videos]
    record["vision"] = vision_record(model, inputs)
    routing: dict[str, list] = {"margins": [], "bias_changed": [], "choices": []}
    handles = routing_hooks(model, routing)
    model.model.rope_deltas = None
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    record["routing_prefill"] = {"min_topk_margin": min(routing["margins"]), "routed_tokens": sum(routing["choices"]),
                                 "bias_changed_choices": sum(routing["bias_changed"])}
    record.update(greedy(model, inputs))
    check_with_cache(model, inputs, record["output_token_ids"])
    record["output_text"] = processor.tokenizer.decode(record["output_token_ids"], skip_special_tokens=False)
    return record


def case_list() -> list[tuple[str, list[dict], list[Image.Image], list[np.ndarray], dict[str, Any]]]:
    image_a = gradient_image(64, 48)
    image_b = checker_image(84, 140, 12)
    frames = video_frames(4, 532, 448)
    text = lambda s: {"type": "text", "text": s}  # noqa: E731
    image_part = {"type": "image_url", "image_url": {"url": "synthetic"}}
    video_part = {"type": "video_url", "video_url": {"url": "synthetic"}}
    return [
        ("text_only", [{"role": "system", "content": "You are a careful assistant."},
                       {"role": "user", "content": "Hello, who are you?"},
                       {"role": "assistant", "content": "I am a small test model."},
                       {"role": "user", "content": [text("Tell me about the weather.")]}], [], [], {}),
        ("one_image", [{"role": "user", "content": [image_part, text("What is in this picture?")]}],
         [image_a], [], {"enable_thinking": False}),
        ("two_images", [{"role": "user", "content": [text("Compare "), image_part, text(" and "), image_part,
                                                     text(". Which is brighter?")]}],
         [image_a, image_b], [], {"enable_thinking": True}),
        ("one_video", [{"role": "user", "content": [video_part, text("Describe the video.")]}],
         [], [frames], {}),
        ("image_and_video",
         [{"role": "user", "content": [image_part, video_part, text("Does the video show the image?")]}],
         [image_b], [frames], {}),
    ]


def template_cases(processor: Ernie4_5_VLMoeProcessor) -> list[dict[str, Any]]:
    """Renders (with transformers' Jinja) and encodings of conversations no model case covers."""
    text = lambda s: {"type": "text", "text": s}  # noqa: E731
    conversations = [
        ([{"role": "system", "content": [text("Be brief.")]}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!", "reasoning_content": "\nThe user greets me.\n"},
          {"role": "user", "content": "Again"}], {}),
        ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"},
          {"role": "user", "content": "Q2"}], {"enable_thinking": True}),
        ([{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "image_url"}, text("x")]}],
         {"enable_thinking": False}),
        ([{"role": "user", "content": "no prompt"}], {"add_generation_prompt": False}),
    ]
    rows = []
    for messages, kwargs in conversations:
        options = {"add_generation_prompt": True, **kwargs}
        prompt = processor.apply_chat_template(messages, tokenize=False, **options)
        rows.append({"messages": messages, "kwargs": kwargs, "prompt": prompt,
                     "input_ids": processor.tokenizer.encode(prompt, add_special_tokens=False)})
    return rows


def video_file_record(processor: Ernie4_5_VLMoeVideoProcessor) -> dict[str, Any]:
    """Decode the mp4 with transformers' PyAV reader, sampling at 2 fps, then the video processor."""
    sampler = lambda metadata, **kw: processor.sample_frames(metadata, fps=2)  # noqa: E731
    frames, metadata = load_video(str(VIDEO_FILE), backend="pyav", sample_indices_fn=sampler)
    all_frames, _ = load_video(str(VIDEO_FILE), backend="pyav",
                               sample_indices_fn=lambda metadata, **kw: np.arange(metadata.total_num_frames))
    out = processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False, return_tensors="np")
    return {
        "file": str(VIDEO_FILE.relative_to(ROOT)), "sample_fps": 2,
        "metadata": {"total_num_frames": metadata.total_num_frames, "fps": metadata.fps,
                     "duration": metadata.duration, "width": metadata.width, "height": metadata.height,
                     "frames_indices": as_list(metadata.frames_indices),
                     "timestamps": [float(t) for t in metadata.timestamps]},
        "decoded_frames": {"shape": list(all_frames.shape), "rgb_sha256": sha256(all_frames),
                           "per_frame_mean": [float(f.mean()) for f in all_frames],
                           "first_frame_row0_first8_rgb": all_frames[0, 0, :8].tolist()},
        "sampled_frames_rgb_sha256": sha256(frames),
        "video_grid_thw": out["video_grid_thw"].tolist(),
        "pixel_values_videos": summary(out["pixel_values_videos"], 5),
        "note": "frames 64x48 are upscaled by smart_resize with the video min_pixels (torchvision bicubic, "
                "antialias) before patchifying; draw_on_frames false",
    }


def sampling_table(processor: Ernie4_5_VLMoeVideoProcessor) -> list[dict[str, Any]]:
    """Ernie4_5_VLMoeVideoProcessor.sample_frames for several videos and requests."""
    rows = []
    for total, fps_in, request in [(8, 4.0, {}), (8, 4.0, {"fps": 2}), (100, 25.0, {}), (100, 25.0, {"fps": 2}),
                                   (1000, 30.0, {"fps": 2}), (1000, 30.0, {}), (60, 30.0, {"num_frames": 20}),
                                   (10, 5.0, {"fps": 1}), (7, 7.0, {})]:
        metadata = VideoMetadata(total_num_frames=total, fps=fps_in)
        try:
            indices = processor.sample_frames(metadata, **request).tolist()
            rows.append({"total_num_frames": total, "fps": fps_in, "request": request, "indices": indices})
        except ValueError as error:
            rows.append({"total_num_frames": total, "fps": fps_in, "request": request, "error": str(error)})
    return rows


def weight_inventory(out: Path) -> dict[str, Any]:
    from safetensors import safe_open

    files = sorted(out.glob("*.safetensors"))
    tensors = {}
    for file in files:
        with safe_open(str(file), "np") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                tensors[name] = {"dtype": sl.get_dtype(), "shape": list(sl.get_shape())}
    return {"files": [f.name for f in files], "tensors": tensors}


# ------------------------------------------------------------------------------------------- main
def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def main() -> None:
    torch.manual_seed(SEED)
    out = fresh_dir(MODEL_DIR)
    write_tokenizer(out)
    tokenizer = load_tokenizer(out)
    token_ids = {f"{key}_id": tokenizer.convert_tokens_to_ids(token) for key, token in NAMED_TOKENS.items()}
    config = build_config(len(tokenizer), token_ids)

    model = Ernie4_5_VLMoeForConditionalGeneration(config).eval()
    randomize(model, SEED)
    save_checkpoint(model, out)
    (out / "model.safetensors").chmod(0o644)
    saved = read_json(out / "config.json")
    saved["dtype"] = "bfloat16"  # save_pretrained writes the in-memory float32; the hub repos say bfloat16
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    write_json(out / "generation_config.json", GENERATION_CONFIG)
    model.float()
    model = check_reload(model, out)

    processor = Ernie4_5_VLMoeProcessor(
        image_processor=Ernie4_5_VLMoeImageProcessorPil(),
        tokenizer=tokenizer,
        video_processor=Ernie4_5_VLMoeVideoProcessor(draw_on_frames=False),
        chat_template=CHAT_TEMPLATE)
    write_processor_configs(processor, out)
    write_mp4(VIDEO_FILE, video_frames(8, 64, 48), fps=4)

    cases = [run_case(name, model, processor, *rest) for name, *rest in case_list()]
    images = [gradient_image(64, 48), checker_image(84, 140, 12), gradient_image(10, 7),
              checker_image(900, 30, 5), gradient_image(333, 500)]
    reference = {
        "generator": "tools/make_ernie45_vl_fixture.py",
        "model": str(MODEL_DIR.relative_to(ROOT)),
        "reference": f"transformers {transformers.__version__} Ernie4_5_VLMoeForConditionalGeneration, torch "
                     f"{torch.__version__}, float32 on bf16-rounded weights (routers float32), eager attention, "
                     "greedy, whole sequence recomputed per step",
        "processors": "Ernie4_5_VLMoeProcessor(Ernie4_5_VLMoeImageProcessorPil, ErnieReferenceTokenizer "
                      "(sentencepiece), Ernie4_5_VLMoeVideoProcessor(draw_on_frames=False))",
        "new_tokens": NEW_TOKENS,
        "token_ids": {**token_ids, "audio_token_id": tokenizer.convert_tokens_to_ids(AUDIO_TOKEN),
                      "bos": 1, "eos": 2, "pad": 0, "cls": tokenizer.convert_tokens_to_ids("<|begin_of_sentence|>"),
                      "sep": tokenizer.convert_tokens_to_ids("<|end_of_sentence|>"),
                      "think": tokenizer.convert_tokens_to_ids("<think>"),
                      "end_think": tokenizer.convert_tokens_to_ids("</think>"), "vocab_size": len(tokenizer)},
        "media_generators": {
            "gradient_image(w, h)": "R = 4x mod 256, G = 5y mod 256, B = 3(x + y) mod 256",
            "checker_image(w, h, cell)": "(230, 40, 40) where (x // cell + y // cell) even, "
                                         "else (20, 60, 200 - y mod 64)",
            "video_frames(n, w, h)": "R = (2x + 16t) mod 256, G = 3y mod 256, B = 255 if 24t+10 <= x < 24t+50 and "
                                     "100 <= y < 140 else 30",
        },
        "chat_template_cases": template_cases(processor),
        "image_processor": {
            "config": {k: as_list(v) for k, v in processor.image_processor.to_dict().items()},
            "cases": [image_processor_record(processor.image_processor, image, i) for i, image in enumerate(images)],
        },
        "video_processor": {
            "config": {k: as_list(v) for k, v in processor.video_processor.to_dict().items()},
            "file_case": video_file_record(processor.video_processor),
            "sample_frames": sampling_table(processor.video_processor),
        },
        "weights": weight_inventory(out),
        "cases": cases,
    }
    REFERENCE.write_text(json.dumps(reference, separators=(",", ":"), default=str) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB), {VIDEO_FILE} ({VIDEO_FILE.stat().st_size} B), "
          f"{REFERENCE} ({REFERENCE.stat().st_size / 1e3:.0f} kB)")
    for case in cases:
        print(f"  {case['name']:16s} prompt {case['num_prompt_tokens']:4d} tokens, out {case['output_token_ids']}, "
              f"min top-2 gap {case['min_top2_logit_gap']:.4f}, routing {case['routing_prefill']}")


if __name__ == "__main__":
    main()
