"""ERNIE-4.5-VL vision tower and resampler against transformers' outputs for the tiny VL fixture
(tools/make_ernie45_vl_fixture.py records summaries of both per case), in both checkpoint layouts.

Tolerance: the reference ran in float32 on the same bf16 weight values this encoder packs exactly, so the
only differences are float32 accumulation order. Measured: values (sampled, head, first/last rows; magnitude
~0.1-3) within 2.5e-6, sums within 6e-8 of the absolute sum, abs_sum and std within 6e-8 relative. Checked
with ~20x margin: values 5e-5 absolute + 1e-5 relative; sum and mean within 1e-6 of the absolute sum (the
sums cancel to a few % of it, so a plain relative bound on them would be loose in a different way);
abs_sum and std 1e-6 relative.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import paddle
import pytest
from PIL import Image

from fastdeploy.model_executor.models.ernie4_5_vl.image_processor import (
    ImageProcessorConfig, normalize, patchify, preprocess_image)
from fastdeploy.model_executor.checkpoint import Checkpoint
from fastdeploy.model_executor.models.ernie4_5_vl.vision import Ernie4_5_VLVisionEncoder, VisionConfig
from fastdeploy.model_executor.weight_format import named_weights

from conftest import compiled_ops

VL = Path(__file__).resolve().parent / "fixtures" / "models" / "ernie45_vl_tiny_hf"
REF = json.loads((VL.parent.parent / "reference" / "ernie45_vl_tiny.json").read_text())
CASES = [c for c in REF["cases"] if c.get("vision")]
VALUE_ATOL, VALUE_RTOL, SUM_TOL = 5e-5, 1e-5, 1e-6


# ---- media, as the fixture tool draws them (REF["media_generators"]) ----
def gradient_image(width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([(4 * x) % 256, (5 * y) % 256, ((x + y) * 3) % 256], -1).astype(np.uint8))


def checker_image(width: int, height: int, cell: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    even = ((x // cell + y // cell) % 2 == 0)[..., None]
    other = np.stack([np.full_like(y, 20), np.full_like(y, 60), 200 - y % 64], axis=-1)
    return Image.fromarray(np.where(even, np.array([230, 40, 40]), other).astype(np.uint8))


def video_frames(count: int, width: int, height: int) -> np.ndarray:
    t, y, x = np.mgrid[0:count, 0:height, 0:width]
    box = (x >= 24 * t + 10) & (x < 24 * t + 50) & (y >= 100) & (y < 140)
    return np.stack([(2 * x + 16 * t) % 256, (3 * y) % 256, np.where(box, 255, 30)], axis=-1).astype(np.uint8)


IMAGES = {"one_image": lambda: [gradient_image(64, 48)],
          "two_images": lambda: [gradient_image(64, 48), checker_image(84, 140, 12)],
          "image_and_video": lambda: [checker_image(84, 140, 12)]}


def image_inputs(case: dict) -> tuple[np.ndarray, list]:
    cfg = ImageProcessorConfig.from_pretrained(VL)
    patches, grids = zip(*(preprocess_image(image, cfg) for image in IMAGES[case["name"]]()))
    assert [list(g) for g in grids] == case["image_grid_thw"]
    return np.concatenate(patches), list(grids)


def video_inputs(case: dict) -> tuple[np.ndarray, list]:
    """The fixture's 4 frames of 532x448 are already multiples of 28 within the video pixel range, so the
    video processor leaves their size alone: each frame is normalised and patchified like an image (checked
    against the recorded pixel summary)."""
    cfg = ImageProcessorConfig.from_pretrained(VL)
    pixels = np.concatenate([patchify(normalize(frame, cfg)[None], cfg)[0] for frame in video_frames(4, 532, 448)])
    expected = case["pixel_values_videos"]
    assert list(pixels.shape) == expected["shape"]
    np.testing.assert_allclose(pixels.reshape(-1)[expected["positions"]], expected["values"], atol=1e-5)
    return pixels, [tuple(g) for g in case["video_grid_thw"]]


def assert_matches(got: np.ndarray, summary: dict, what: str) -> float:
    """Checks `got` against a reference summary; returns the largest value difference."""
    flat = got.astype(np.float64).reshape(-1)
    assert list(got.shape) == summary["shape"], what
    for key, value in (("abs_sum", np.abs(flat).sum()), ("std", flat.std())):
        assert value == pytest.approx(summary[key], rel=SUM_TOL), f"{what}: {key}"
    assert abs(flat.sum() - summary["sum"]) <= SUM_TOL * summary["abs_sum"], f"{what}: sum"
    assert abs(flat.mean() - summary["mean"]) <= SUM_TOL * summary["abs_sum"] / flat.size, f"{what}: mean"
    picked = flat[summary["positions"]]
    np.testing.assert_allclose(picked, summary["values"], atol=VALUE_ATOL, rtol=VALUE_RTOL, err_msg=what)
    np.testing.assert_allclose(flat[:len(summary["head"])], summary["head"], atol=VALUE_ATOL, rtol=VALUE_RTOL,
                               err_msg=what)
    return float(max(np.abs(picked - summary["values"]).max(), np.abs(flat[:16] - summary["head"]).max()))


# ---- checkpoints in the other layouts, written from the fixture's own tensors ----
def write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """uint16 arrays (bf16 bits) -> a safetensors file with dtype BF16."""
    header, offset = {}, 0
    for name, bits in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [offset, offset + bits.nbytes]}
        offset += bits.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for bits in tensors.values():
            f.write(np.ascontiguousarray(bits, dtype="<u2").tobytes())


def fixture_vision_bits() -> dict[str, np.ndarray]:
    """The fixture's vision and resampler tensors (bf16 bits) under their names without `model.`."""
    with Checkpoint(str(VL)) as ckpt:
        return {name.removeprefix("model."): np.array(ckpt.lazy(name).raw) for name in ckpt.tensors
                if name.startswith(("model.vision_model.", "model.resampler_model."))}


def baidu_config() -> dict:
    """The fixture's config as Baidu's repos write it: flat text fields, embed_dim / mlp_ratio."""
    hf = json.loads((VL / "config.json").read_text())
    vision, text = hf["vision_config"], hf["text_config"]
    return {"architectures": ["Ernie4_5_VLMoeForConditionalGeneration"], "dtype": "bfloat16",
            "hidden_size": text["hidden_size"], "rms_norm_eps": text["rms_norm_eps"], "spatial_conv_size": 2,
            "temporal_conv_size": 2, "pixel_hidden_size": vision["hidden_size"],
            "vision_config": {"depth": vision["depth"], "embed_dim": vision["hidden_size"],
                              "hidden_size": vision["hidden_size"], "mlp_ratio": 4, "num_heads": vision["num_heads"],
                              "patch_size": 14, "in_channels": 3, "spatial_merge_size": 2,
                              "hidden_act": "quick_gelu"}}


def layout_copy(root: Path, resampler_prefix: str = "resampler_model.", in_out: bool = True,
                drop: str | None = None) -> Path:
    """A copy as Baidu's repos store it: `vision_model.*`, `<resampler_prefix>*`, 2-D weights [in, out]
    (-Paddle) or [out, in] (-PT), flat config."""
    out = root / f"{resampler_prefix.rstrip('.')}_{'in_out' if in_out else 'out_in'}"
    out.mkdir()
    tensors = {}
    for name, bits in fixture_vision_bits().items():
        if name.startswith("resampler_model."):
            name = resampler_prefix + name.removeprefix("resampler_model.")
        if name != drop:
            tensors[name] = bits.T if bits.ndim == 2 and in_out else bits
    write_bf16_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(baidu_config()))
    return out


# ---- the encoders, and their outputs per (layout, kind) ----
@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ernie4_5_VLVisionEncoder]:
    paddle_dir = layout_copy(tmp_path_factory.mktemp("vl"))
    return {"hf": Ernie4_5_VLVisionEncoder.from_pretrained(VL, dtype="float32"),
            "paddle": Ernie4_5_VLVisionEncoder.from_pretrained(paddle_dir, dtype="float32")}


_OUTPUTS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def run(encoder: Ernie4_5_VLVisionEncoder, layout: str, pixels: np.ndarray, grid: list
        ) -> tuple[np.ndarray, np.ndarray]:
    key = (layout, tuple(grid))
    if key not in _OUTPUTS:
        tower = encoder.vision_model(paddle.to_tensor(pixels), grid)
        _OUTPUTS[key] = tower.numpy(), encoder.resampler_model(tower, grid).numpy()
    return _OUTPUTS[key]


@pytest.mark.parametrize("layout", ["hf", "paddle"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_tower_and_resampler_match_the_reference(encoders, layout, case):
    for kind, inputs in (("image", image_inputs), ("video", video_inputs)):
        if kind not in case["vision"]:
            continue
        ref = case["vision"][kind]
        pixels, grid = inputs(case)
        tower, tokens = run(encoders[layout], layout, pixels, grid)
        assert_matches(tower, ref["vision_tower_output"], f"{case['name']} {kind} tower")
        assert_matches(tokens, ref["resampler_output"], f"{case['name']} {kind} resampler")
        for row, key in ((0, "resampler_output_first_row"), (-1, "resampler_output_last_row")):
            np.testing.assert_allclose(tokens[row, :16], ref[key], atol=VALUE_ATOL, rtol=VALUE_RTOL)


def test_images_and_videos_in_one_call_keep_their_order(encoders):
    case = next(c for c in CASES if c["name"] == "image_and_video")
    (image_pixels, image_grid), (video_pixels, video_grid) = image_inputs(case), video_inputs(case)
    tokens = encoders["hf"](paddle.to_tensor(np.concatenate([image_pixels, video_pixels])),
                            image_grid + video_grid).numpy()
    image_tokens = run(encoders["hf"], "hf", image_pixels, image_grid)[1]
    assert tokens.shape == (15 + 4 * 32 * 38 // 8, 64)
    np.testing.assert_allclose(tokens[:15], image_tokens, atol=1e-6)
    assert_matches(tokens[15:], case["vision"]["video"]["resampler_output"], "video after an image")


def test_pure_paddle_fallback_matches_too(encoders):
    case = next(c for c in CASES if c["name"] == "two_images")
    pixels, grid = image_inputs(case)
    with compiled_ops(False):
        tokens = encoders["hf"](paddle.to_tensor(pixels), grid).numpy()
    assert_matches(tokens, case["vision"]["image"]["resampler_output"], "reference ops")


def test_wint8_stays_close():
    case = next(c for c in CASES if c["name"] == "two_images")
    pixels, grid = image_inputs(case)
    tokens = Ernie4_5_VLVisionEncoder.from_pretrained(VL, quantization="wint8")(paddle.to_tensor(pixels), grid)
    ref = run(Ernie4_5_VLVisionEncoder.from_pretrained(VL), "hf", pixels, grid)[1]
    assert np.abs(tokens.numpy() - ref).mean() < 0.05 * np.abs(ref).mean()


def test_both_config_styles_give_the_same_settings():
    hf = VisionConfig.from_hf_config(json.loads((VL / "config.json").read_text()))
    assert hf == VisionConfig.from_hf_config(baidu_config())
    assert (hf.depth, hf.width, hf.num_heads, hf.head_dim, hf.intermediate_size) == (2, 32, 2, 16, 128)
    assert (hf.text_hidden_size, hf.text_rms_norm_eps, hf.layer_norm_eps, hf.rope_theta) == (64, 1e-5, 1e-6, 10000.0)
    assert (hf.patch_dim, hf.spatial_merge_size, hf.temporal_merge_size) == (588, 2, 2)
    with pytest.raises(ValueError, match="temporal merge size 3"):
        VisionConfig.from_hf_config({**baidu_config(), "temporal_conv_size": 3})
    with pytest.raises(ValueError, match="vision_config"):
        VisionConfig.from_hf_config({"hidden_size": 64})


@pytest.mark.parametrize("prefix, in_out, layout", [("resampler_model.", True, "paddle"),
                                                     ("ernie.resampler_model.", True, "paddle"),
                                                     ("model.resampler_model.", False, "hf")])  # Baidu's -PT
def test_every_naming_loads_the_same_weights(encoders, tmp_path, prefix, in_out, layout):
    encoder = Ernie4_5_VLVisionEncoder(VisionConfig.from_hf_config(baidu_config()))
    with Checkpoint(str(layout_copy(tmp_path, prefix, in_out))) as ckpt:
        assert encoder.load_weights(ckpt) == layout
    expected = named_weights(encoders["hf"])
    got = named_weights(encoder)
    assert sorted(got) == sorted(expected)
    for name, value in got.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_a_missing_vision_tensor_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"missing vision tensors \(1\): vision_model\.blocks\.1\.attn\.qkv\.bias"):
        Ernie4_5_VLVisionEncoder.from_pretrained(
            layout_copy(tmp_path, drop="vision_model.blocks.1.attn.qkv.bias"))
    hf_copy = tmp_path / "hf"
    hf_copy.mkdir()
    shutil.copy(VL / "config.json", hf_copy)
    write_bf16_safetensors(hf_copy / "model.safetensors", {
        "model." + name: bits for name, bits in fixture_vision_bits().items() if name != "resampler_model.mlp.bias"})
    with pytest.raises(ValueError, match=r"missing vision tensors \(1\): model\.resampler_model\.mlp\.bias"):
        Ernie4_5_VLVisionEncoder.from_pretrained(hf_copy)


def test_bad_inputs_are_refused(encoders):
    pixels = paddle.zeros([16, 588])
    with pytest.raises(ValueError, match="grid_thw"):
        encoders["hf"](pixels, [(1, 3, 4)])  # h not a multiple of the merge size
    with pytest.raises(ValueError, match="grid_thw"):
        encoders["hf"](pixels, [(3, 2, 2)])  # odd frame count of a video
    with pytest.raises(ValueError, match=r"pixel_values must be float32 \[32, 588\]"):
        encoders["hf"](pixels, [(2, 4, 4)])
