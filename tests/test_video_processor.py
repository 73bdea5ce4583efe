"""ERNIE-4.5-VL video preprocessing against transformers' Ernie4_5_VLMoeVideoProcessor (outputs recorded by
tools/make_ernie45_vl_fixture.py in tests/fixtures/reference/ernie45_vl_tiny.json, key video_processor),
FastDeploy's frame sampling rule, the input forms and the timestamp drawing."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from fastdeploy.model_executor.models.ernie4_5_vl.video_processor import (
    VideoProcessorConfig,
    draw_timestamp,
    format_timestamp,
    preprocess_frames,
    process_video,
    read_video,
    resize_frame,
    sample_frame_indices,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests/fixtures/models/ernie45_vl_tiny_hf"
VIDEO = ROOT / "tests/fixtures/media/ernie45_vl_tiny.mp4"  # 8 frames 64x48 at 4 fps: 2.0 s
FIXTURE = json.loads((ROOT / "tests/fixtures/reference/ernie45_vl_tiny.json").read_text())
REF = FIXTURE["video_processor"]
FILE_CASE = REF["file_case"]


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def assert_summary(values: np.ndarray, ref: dict) -> None:
    """The fixture's summary of transformers' pixel_values: within 1e-4 on sums and sampled values."""
    flat = values.astype(np.float64).reshape(-1)
    assert list(values.shape) == ref["shape"] and values.dtype == np.float32
    assert abs(flat.sum() - ref["sum"]) < 1e-4 and abs(np.abs(flat).sum() - ref["abs_sum"]) < 1e-4
    np.testing.assert_allclose(flat[: len(ref["head"])], ref["head"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(flat[ref["positions"]], ref["values"], rtol=0, atol=1e-4)
    assert flat.mean() == pytest.approx(ref["mean"], abs=1e-9) and flat.std() == pytest.approx(ref["std"], abs=1e-9)


@pytest.fixture(scope="module")
def reference_cfg() -> VideoProcessorConfig:
    """The fixture's processor config with transformers' sampling at 2 fps, as the file case was made."""
    return VideoProcessorConfig.from_pretrained(MODEL, sampling="transformers", fps=2)


@pytest.fixture(scope="module")
def reference_video(reference_cfg):
    return process_video(str(VIDEO), reference_cfg)


def test_config_from_the_fixture_checkpoint(reference_cfg):
    cfg = VideoProcessorConfig.from_pretrained(MODEL)
    config = REF["config"]
    assert (cfg.min_pixels, cfg.max_pixels) == (config["size"]["shortest_edge"], config["size"]["longest_edge"])
    assert (cfg.min_frames, cfg.max_frames, cfg.draw_on_frames) == (config["min_frames"], config["max_frames"], False)
    assert (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size) == (14, 2, 2)
    assert cfg.mean == tuple(config["image_mean"]) and cfg.std == tuple(config["image_std"])
    assert (cfg.sampling, cfg.fps, cfg.target_frames, cfg.font) == ("fastdeploy", None, None, None)
    assert (reference_cfg.sampling, reference_cfg.fps) == ("transformers", 2)


def test_file_case_equals_the_reference_processor(reference_video):
    meta = FILE_CASE["metadata"]
    assert [list(reference_video.grid_thw)] == FILE_CASE["video_grid_thw"]
    assert list(reference_video.frame_indices) == meta["frames_indices"]
    assert list(reference_video.timestamps) == meta["timestamps"]
    assert_summary(reference_video.pixel_values, FILE_CASE["pixel_values_videos"])


def test_decoded_frames_equal_the_reference_decoder(reference_cfg):
    every = VideoProcessorConfig.from_pretrained(MODEL, sampling="transformers")  # no fps: all 8 frames
    frames, indices, seconds = read_video(VIDEO.read_bytes(), every)
    decoded = FILE_CASE["decoded_frames"]
    assert list(frames.shape) == decoded["shape"] and frames.dtype == np.uint8
    assert sha256(frames) == decoded["rgb_sha256"]
    np.testing.assert_allclose(frames.reshape(len(frames), -1).mean(axis=1), decoded["per_frame_mean"], rtol=1e-12)
    assert frames[0, 0, :8].tolist() == decoded["first_frame_row0_first8_rgb"]
    sampled, _, _ = read_video(VIDEO.read_bytes(), reference_cfg)
    assert sha256(sampled) == FILE_CASE["sampled_frames_rgb_sha256"]


@pytest.mark.parametrize("row", REF["sample_frames"], ids=lambda r: f"{r['total_num_frames']}-{r['request']}")
def test_transformers_sampling_rule(row):
    request = {("target_frames" if k == "num_frames" else k): v for k, v in row["request"].items()}
    cfg = VideoProcessorConfig(sampling="transformers").for_request(request)
    if "error" in row:
        with pytest.raises(ValueError):
            sample_frame_indices(row["total_num_frames"], row["fps"], cfg)
    else:
        assert sample_frame_indices(row["total_num_frames"], row["fps"], cfg) == row["indices"]


def test_pre_decoded_frames_equal_the_reference_processor():
    """The one_video case: four 532x448 frames from the fixture's formula, which needs no resize."""
    case = next(c for c in FIXTURE["cases"] if c["name"] == "one_video")
    t, y, x = np.mgrid[0:4, 0:448, 0:532]
    box = (x >= 24 * t + 10) & (x < 24 * t + 50) & (y >= 100) & (y < 140)
    frames = np.stack([(2 * x + 16 * t) % 256, (3 * y) % 256, np.where(box, 255, 30)], axis=-1).astype(np.uint8)
    assert sha256(frames) == case["videos"][0]["rgb_sha256"]
    pixel_values, grid = preprocess_frames(frames, VideoProcessorConfig.from_pretrained(MODEL))
    assert [list(grid)] == case["video_grid_thw"]
    assert_summary(pixel_values, case["pixel_values_videos"])


# FastDeploy's rule on the fixture (8 frames, 4 fps, duration 2.0 s), derived by hand:
# - defaults (fps 2, min 16, max 180): int(2.0 * 2) = 4 < 16 -> 16 frames, capped at the 8 there are:
#   linspace(0, 8, 9) -> intervals starting at 0..7 -> [0..7]; timestamps i * 2.0 / 8
# - min_frames 1: 4 frames within [1, 180] -> fps sampling: seconds arange(0, 2.0, 0.5) = 0, .5, 1, 1.5,
#   times 4 fps -> [0, 2, 4, 6]
# - fps 1, min 1, middle: seconds arange(0.5, 2.5, 1) = .5, 1.5 -> [2, 6]
# - fps 4, min 1, max 6: int(2.0 * 4) = 8 > 6 -> 6 frames: linspace(0, 8, 7) = 0, 1.33, 2.67, 4, 5.33, 6.67, 8
#   -> int [0, 1, 2, 4, 5, 6, 8] -> starts [0, 1, 2, 4, 5, 6]
# - target 3 (fps then unset), min 1: linspace(0, 8, 4) -> int [0, 2, 5, 8] -> starts [0, 2, 5], odd ->
#   the last repeated: [0, 2, 5, 5]; middle: (0+1)//2, (2+4)//2, (5+7)//2 = [0, 3, 6] -> [0, 3, 6, 6]
# - FastDeploy's -1 means unset: {"fps": -1, "target_frames": 3} is target 3
FASTDEPLOY_CASES = [
    ({}, [0, 1, 2, 3, 4, 5, 6, 7]),
    ({"min_frames": 1}, [0, 2, 4, 6]),
    ({"fps": 1, "min_frames": 1, "frames_sample": "middle"}, [2, 6]),
    ({"fps": 4, "min_frames": 1, "max_frames": 6}, [0, 1, 2, 4, 5, 6]),
    ({"target_frames": 3, "min_frames": 1}, [0, 2, 5, 5]),
    ({"target_frames": 3, "min_frames": 1, "frames_sample": "middle"}, [0, 3, 6, 6]),
    ({"fps": -1, "target_frames": 3, "min_frames": 1}, [0, 2, 5, 5]),
]


@pytest.mark.parametrize("options,indices", FASTDEPLOY_CASES, ids=lambda v: str(v))
def test_fastdeploy_sampling_rule_on_the_fixture(options, indices, reference_video):
    cfg = VideoProcessorConfig.from_pretrained(MODEL)
    video = process_video({"video": VIDEO.read_bytes(), **options}, cfg)
    assert list(video.frame_indices) == indices
    assert video.timestamps == pytest.approx([i * 2.0 / 8 for i in indices], abs=1e-12)
    assert video.grid_thw == (len(indices), 30, 40)
    # each frame's rows are that frame's rows in the reference (every frame, in order)
    rows = 30 * 40
    expected = np.concatenate([reference_video.pixel_values[i * rows:(i + 1) * rows] for i in indices])
    np.testing.assert_array_equal(video.pixel_values, expected)


def test_sources_bytes_path_file_url_and_dict(reference_cfg, reference_video):
    data = VIDEO.read_bytes()
    for source in (data, VIDEO, VIDEO.as_uri(), {"video": VIDEO.as_uri()}, {"video": data, "fps": 2}):
        video = process_video(source, reference_cfg)
        assert video.frame_indices == reference_video.frame_indices
        np.testing.assert_array_equal(video.pixel_values, reference_video.pixel_values)


@pytest.mark.parametrize("options,name", [
    ({"fps": 0}, "fps"), ({"fps": "2"}, "fps"), ({"fps": -2}, "fps"), ({"min_frames": 0}, "min_frames"),
    ({"max_frames": 8}, "min_frames"), ({"min_frames": 1.5}, "min_frames"), ({"target_frames": 2}, "target_frames"),
    ({"target_frames": 200}, "target_frames"), ({"target_frames": True}, "target_frames"),
    ({"fps": 2, "target_frames": 20}, "mutually exclusive"), ({"frames_sample": "rand"}, "frames_sample"),
    ({"max_frame": 30}, "max_frame"),
])
def test_bad_request_options_name_the_parameter(options, name):
    with pytest.raises(ValueError, match=name):
        process_video({"video": VIDEO.read_bytes(), **options}, VideoProcessorConfig())


@pytest.mark.parametrize("overrides,name", [
    ({"sampling": "vllm"}, "sampling"), ({"temporal_patch_size": 1}, "temporal_patch_size"),
    ({"min_pixels": 10**7}, "min_pixels"), ({"max_pixels": 0}, "max_pixels"), ({"patch_size": 14.0}, "patch_size"),
    ({"size": 5}, "size"),
])
def test_bad_config_names_the_parameter(overrides, name):
    with pytest.raises(ValueError, match=name):
        VideoProcessorConfig.from_pretrained(MODEL, **overrides)


def test_bad_sources_and_frames():
    with pytest.raises(ValueError, match="'video' key"):
        process_video({"fps": 2}, VideoProcessorConfig())
    with pytest.raises(ValueError, match="could not be decoded as a video"):
        process_video(b"not a video at all" * 10, VideoProcessorConfig())
    with pytest.raises(ValueError, match="could not read"):
        process_video(str(VIDEO) + ".missing", VideoProcessorConfig())
    with pytest.raises(ValueError, match="target_frames"):  # transformers refuses more frames than there are
        process_video({"video": VIDEO.read_bytes(), "target_frames": 20},
                      VideoProcessorConfig(sampling="transformers"))
    with pytest.raises(ValueError, match="uint8"):
        preprocess_frames(np.zeros((2, 28, 28, 3), np.float32), VideoProcessorConfig(draw_on_frames=False))


def test_config_fallbacks(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 14, "merge_size": 2, "size": {"shortest_edge": 3136, "longest_edge": 4842768}}))
    cfg = VideoProcessorConfig.from_pretrained(tmp_path, fps=1)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.fps) == (299 * 28 * 28, 1196 * 28 * 28, 1)  # not the image bounds
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"num_frames": 32, "fps": None, "draw_on_frames": True, "font": "Some.ttf", "do_resize": True}))
    cfg = VideoProcessorConfig.from_pretrained(tmp_path)
    assert (cfg.target_frames, cfg.fps, cfg.draw_on_frames, cfg.font) == (32, None, True, None)  # font absent
    (tmp_path / "Some.ttf").write_bytes(ImageFont.load_default(size=10).path.getvalue())  # Pillow's bundled font
    assert VideoProcessorConfig.from_pretrained(tmp_path).font == str(tmp_path / "Some.ttf")


def test_resize_equals_torchvision_bicubic_antialias():
    """sha256 of torchvision.transforms.v2.functional.resize(uint8, bicubic, antialias=True) outputs for this
    frame, recorded with torch 2.13 / torchvision 0.28 (AVX2) in /work/refenv: up, down and one-axis resizes."""
    y, x = np.mgrid[0:50, 0:70]
    frame = np.stack([(7 * x + 3 * y) % 256, (x * y) % 256, np.where((x // 5 + y // 5) % 2, 250, 5)], -1)
    frame = frame.astype(np.uint8)
    expected = {
        (28, 56): "1aa6a0f12273cd01b1d1242bff704c1a482285dd1d668e437fb566fe8673cce5",
        (112, 28): "fb5fcb542fc1b09fb2123828ef6eb419659ed394c67ab6c3f996df1ae26bf610",
        (50, 33): "267f4d448e980f054c30d92ecc946c455fadf292a36270627f5fd2819bba76ac",
        (17, 70): "9b265eba4443f49aceff75636263f977a9a3665c31990c5c413a221e1209f2cb",
    }
    for (h, w), digest in expected.items():
        assert sha256(resize_frame(frame, h, w)) == digest, (h, w)
    assert resize_frame(frame, 50, 70) is frame


def test_timestamp_text():
    assert format_timestamp(0.25) == "time: 00:00:00.25"
    assert format_timestamp(3725.5) == "time: 01:02:05.50"


def _text_box(width: int, height: int, seconds: float) -> tuple[int, int, int, int]:
    size = int(min(width, height) * 0.1)
    draw = ImageDraw.Draw(Image.new("RGB", (width, height)))
    return draw.textbbox((0, 0), format_timestamp(seconds), font=ImageFont.load_default(size=size),
                         stroke_width=int(size * 0.1))


def test_drawing_marks_only_the_top_left_corner():
    frame = np.full((200, 300, 3), 128, np.uint8)
    drawn = draw_timestamp(frame, 3725.5)
    left, top, right, bottom = _text_box(300, 200, 3725.5)
    assert right < 250 and bottom < 40
    changed = np.argwhere((drawn != frame).any(axis=-1))
    assert len(changed) > 100 and changed[:, 0].max() < bottom + 1 and changed[:, 1].max() < right + 1
    assert (drawn == 0).all(axis=-1).any() and (drawn == 255).all(axis=-1).any()  # black text, white stroke
    assert (frame == 128).all()  # the input is not modified


def test_drawing_in_the_pipeline_changes_only_top_left_patches():
    cfg = VideoProcessorConfig(min_pixels=28 * 28, draw_on_frames=True)
    frames = np.full((3, 280, 420, 3), 128, np.uint8)  # odd: the last frame is repeated, with its timestamp
    drawn, grid = preprocess_frames(frames, cfg, [0.0, 0.5, 1.0])
    plain, _ = preprocess_frames(frames, VideoProcessorConfig(min_pixels=28 * 28, draw_on_frames=False))
    assert grid == (4, 20, 30)
    changed = np.flatnonzero((drawn != plain).any(axis=1))
    frame, block = np.divmod(changed, 20 * 30)
    block_row, block_col, i, j = block // 60, block // 4 % 15, block // 2 % 2, block % 2  # merge-block order
    patch_row, patch_col = 2 * block_row + i, 2 * block_col + j
    _, _, right, bottom = _text_box(420, 280, 1.0)
    assert set(frame) == {0, 1, 2, 3}
    assert (patch_row * 14 < bottom).all() and (patch_col * 14 < right).all()
    np.testing.assert_array_equal(drawn[2 * 600:3 * 600], drawn[3 * 600:])  # the repeated frame


def test_container_without_a_frame_count(tmp_path, reference_cfg, reference_video):
    """Matroska does not record the frame count: it is counted from the packets."""
    import av

    path = tmp_path / "tiny.mkv"
    with av.open(str(VIDEO)) as source, av.open(str(path), "w", format="matroska") as target:
        stream = target.add_stream_from_template(source.streams.video[0])
        for packet in source.demux(source.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                target.mux(packet)
    with av.open(str(path)) as check:
        assert check.streams.video[0].frames == 0
    video = process_video(path, reference_cfg)
    assert video.frame_indices == reference_video.frame_indices
    np.testing.assert_array_equal(video.pixel_values, reference_video.pixel_values)
