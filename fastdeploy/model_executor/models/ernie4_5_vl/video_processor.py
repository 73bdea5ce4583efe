"""ERNIE-4.5-VL video preprocessing: a video -> the vision tower's flattened patches and grid.

Same pixels as transformers' Ernie4_5_VLMoeVideoProcessor (tested against it):
1. decode with PyAV (frames counted in decode order, converted to RGB only when sampled);
2. pick frames by FastDeploy's rule (the default) or transformers' (`VideoProcessorConfig.sampling`);
3. optionally draw "time: HH:MM:SS.ss" in the top-left corner, then repeat the last frame to an even count;
4. one `smart_resize` per video with the video pixel bounds, resized like torchvision's uint8 antialiased
   bicubic (integer taps, horizontal pass first), normalised in float32 as torchvision does, and
   patchified per frame: one row per patch of one frame, [T * gh * gw, 3 * p * p] (merge-block order,
   channel-major rows) — the resampler merges frame pairs, not this processor.
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Union

import av
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from fastdeploy.input.media import TRUSTED, MediaPolicy, read_bytes
from fastdeploy.model_executor.models.ernie4_5_vl.image_processor import (
    CLIP_MEAN, CLIP_STD, ImageProcessorConfig, patchify, smart_resize)

logger = logging.getLogger(__name__)

SAMPLING_RULES = ("fastdeploy", "transformers")
FRAMES_SAMPLE = ("leading", "middle")
REQUEST_KEYS = ("fps", "min_frames", "max_frames", "target_frames", "frames_sample")
FASTDEPLOY_DEFAULT_FPS = 2.0
VideoSource = Union[bytes, str, os.PathLike, Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class VideoProcessorConfig:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2  # frames per temporal patch; ERNIE-4.5-VL supports only 2
    min_pixels: int = 299 * 28 * 28
    max_pixels: int = 1196 * 28 * 28
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    sampling: str = "fastdeploy"  # or "transformers"
    fps: float | None = None  # None: FastDeploy samples at 2 fps, transformers takes every frame (<= max)
    min_frames: int = 16
    max_frames: int = 180
    target_frames: int | None = None  # a fixed frame count instead of fps (transformers' num_frames)
    frames_sample: str = "leading"  # FastDeploy's rule: first or middle frame of each interval
    draw_on_frames: bool = True
    font: str | None = None  # a TrueType file; None: Pillow's bundled default font

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "min_pixels", "max_pixels", "min_frames", "max_frames",
                     "target_frames"):
            value = getattr(self, name)
            if (value is not None or name != "target_frames") and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.temporal_patch_size != 2:
            raise ValueError(f"temporal_patch_size must be 2 for ERNIE-4.5-VL, got {self.temporal_patch_size!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
        if self.min_frames > self.max_frames:
            raise ValueError(f"min_frames ({self.min_frames}) must not exceed max_frames ({self.max_frames})")
        if self.fps is not None and (isinstance(self.fps, bool) or not isinstance(self.fps, (int, float))
                                     or not 0 < self.fps < math.inf):
            raise ValueError(f"fps must be a positive number or None, got {self.fps!r}")
        if self.target_frames is not None and not self.min_frames <= self.target_frames <= self.max_frames:
            raise ValueError(f"target_frames ({self.target_frames}) must be within min_frames ({self.min_frames}) "
                             f"and max_frames ({self.max_frames})")
        if self.target_frames is not None and self.fps is not None:
            raise ValueError("fps and target_frames are mutually exclusive: give one of them")
        if self.sampling not in SAMPLING_RULES:
            raise ValueError(f"sampling must be one of {list(SAMPLING_RULES)}, got {self.sampling!r}")
        if self.frames_sample not in FRAMES_SAMPLE:
            raise ValueError(f"frames_sample must be one of {list(FRAMES_SAMPLE)}, got {self.frames_sample!r}")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], **overrides: Any) -> VideoProcessorConfig:
        """From the checkpoint's video_preprocessor_config.json (transformers' keys: `size`, `num_frames`, a
        `font` file beside it); without one, only patch/merge sizes and mean/std are read from
        preprocessor_config.json (its pixel bounds are the image ones). `overrides` are field names."""
        directory, names = Path(directory), {f.name for f in fields(cls)}
        video_file, image_file = directory / "video_preprocessor_config.json", directory / "preprocessor_config.json"
        if video_file.is_file():
            raw = json.loads(video_file.read_text())
        else:
            image = json.loads(image_file.read_text()) if image_file.is_file() else {}
            raw = {k: image[k] for k in ("patch_size", "merge_size", "image_mean", "image_std") if k in image}
        renamed = {"image_mean": "mean", "image_std": "std", "num_frames": "target_frames"}
        values = {renamed.get(k, k): v for k, v in raw.items() if renamed.get(k, k) in names and v is not None}
        size = raw.get("size") or {}
        values.update({name: size[key] for key, name in (("shortest_edge", "min_pixels"),
                                                         ("longest_edge", "max_pixels")) if key in size})
        values.update({name: tuple(values[name]) for name in ("mean", "std") if name in values})
        font = values.pop("font", None)
        if font and (directory / font).is_file():
            values["font"] = str(directory / font)
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown video processor options {unknown}")
        return cls(**{**values, **overrides})

    def for_request(self, options: Mapping[str, Any]) -> VideoProcessorConfig:
        """This config with one video's options (FastDeploy's keys; -1 means unset). A request's fps
        replaces the config's target_frames and vice versa; giving both is an error."""
        unknown = sorted(set(options) - set(REQUEST_KEYS))
        if unknown:
            raise ValueError(f"unknown video options {unknown}; expected some of {list(REQUEST_KEYS)}")
        changes = {k: None if k in ("fps", "target_frames") and type(v) in (int, float) and v == -1 else v
                   for k, v in options.items()}
        for given, cleared in (("fps", "target_frames"), ("target_frames", "fps")):
            if changes.get(given) is not None:
                changes.setdefault(cleared, None)
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class ProcessedVideo:
    pixel_values: np.ndarray  # float32 [T * gh * gw, 3 * patch_size**2], T = len(frame_indices)
    grid_thw: tuple[int, int, int]  # (T, gh, gw): frames after padding to an even count, patch rows, columns
    frame_indices: tuple[int, ...]  # decoded frame per row block, the last repeated if the count was odd
    timestamps: tuple[float, ...]  # seconds, one per frame as above


def sample_frame_indices(total_frames: int, video_fps: float, cfg: VideoProcessorConfig) -> list[int]:
    """Which decoded frames to keep, by cfg.sampling's rule."""
    if total_frames < 1:
        raise ValueError("the video has no frames")
    if cfg.sampling == "transformers":
        count = cfg.target_frames
        if count is not None and count > total_frames:
            raise ValueError(f"target_frames ({count}) exceeds the video's {total_frames} frames")
        if count is None:
            wanted = total_frames / video_fps * cfg.fps if cfg.fps is not None else total_frames
            count = min(max(wanted, cfg.min_frames), cfg.max_frames, total_frames)
        # torch.arange(0, total, total / count) in float32, truncated
        step = total_frames / count
        positions = (np.arange(math.ceil(total_frames / step), dtype=np.float64) * step).astype(np.float32)
        return positions.astype(np.int64).tolist()
    target, fps = cfg.target_frames, cfg.fps if cfg.fps is not None else FASTDEPLOY_DEFAULT_FPS
    duration = total_frames / video_fps
    if target is None:
        by_fps = int(duration * fps)
        if by_fps < cfg.min_frames:
            target = cfg.min_frames
        elif by_fps > cfg.max_frames:
            target = cfg.max_frames
    if target is None:  # sample at fps: one frame per 1/fps seconds
        delta = 1.0 / fps
        seconds = np.arange(0.0, duration, delta) if cfg.frames_sample == "leading" else \
            np.arange(delta / 2, duration + delta / 2, delta)
        return [int(i) for i in np.around(seconds * video_fps).astype(np.int64) if i < total_frames]
    bounds = np.linspace(0, total_frames, min(target, total_frames) + 1).astype(np.int64)
    if cfg.frames_sample == "leading":
        return bounds[:-1].tolist()
    return ((bounds[:-1] + bounds[1:] - 1) // 2).tolist()


def format_timestamp(seconds: float) -> str:
    hours, rest = divmod(seconds, 3600)
    minutes, rest = divmod(rest, 60)
    return f"time: {int(hours):02d}:{int(minutes):02d}:{rest:05.2f}"


def draw_timestamp(frame: np.ndarray, seconds: float, font: str | None = None) -> np.ndarray:
    """Black text with a white stroke at (0, 0), 10% of the shorter side high, as FastDeploy and
    transformers draw it."""
    image = Image.fromarray(frame)
    size = int(min(image.size) * 0.1)
    if size < 1:
        return frame
    # Both references draw with Roboto-Regular.ttf, which they download; without network we use the
    # checkpoint's font file when it ships one, else Pillow's bundled scalable default font
    # (ImageFont.load_default(size=...)), so the glyphs differ slightly from the reference's.
    face = ImageFont.truetype(font, size) if font else ImageFont.load_default(size=size)
    ImageDraw.Draw(image).text((0, 0), format_timestamp(seconds), font=face, fill=(0, 0, 0),
                               stroke_width=int(size * 0.1), stroke_fill=(255, 255, 255))
    return np.asarray(image)


def _resize_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """torch's uint8 antialiased bicubic taps: first input index per output, integer weights, precision."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = math.ceil(support) * 2 + 1
    center = scale * (np.arange(out_size) + 0.5)
    start = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C casts truncate
    count = np.clip(np.minimum((center + support + 0.5).astype(np.int64), in_size) - start, 0, taps)
    offsets, a = np.arange(taps), -0.5  # Keys' cubic with a = -0.5, as Pillow's bicubic
    x = np.abs((offsets + start[:, None] - center[:, None] + 0.5) * (1.0 / scale if scale >= 1.0 else 1.0))
    cubic = np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                     np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))
    weights = np.where(offsets < count[:, None], cubic, 0.0)
    total = np.cumsum(weights, axis=1)[:, -1:]  # summed left to right, as torch does
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    precision, top = 0, weights.max()
    while precision < 22 and int(0.5 + top * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    return start, np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)), precision


def _resample_rows(image: np.ndarray, out_size: int) -> np.ndarray:
    """One pass along axis 0 of a uint8 [H, W, 3] image in torch's int32 fixed-point arithmetic."""
    start, weights, precision = _resize_taps(image.shape[0], out_size)
    padded = np.pad(image, [(0, weights.shape[1]), (0, 0), (0, 0)])  # taps past the edge weigh 0
    acc = np.full((out_size, *image.shape[1:]), 1 << (precision - 1), np.int32)
    for k, column in enumerate(weights.T.astype(np.int32)):
        acc += padded[start + k] * column[:, None, None]
    return np.clip(acc >> precision, 0, 255).astype(np.uint8)


def resize_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] -> [height, width, 3], equal to torchvision's bicubic antialiased uint8 resize
    (horizontal pass first, then vertical)."""
    if frame.shape[1] != width:
        frame = _resample_rows(frame.transpose(1, 0, 2), width).transpose(1, 0, 2)
    if frame.shape[0] != height:
        frame = _resample_rows(frame, height)
    return frame


def normalize_frame(pixels: np.ndarray, cfg: VideoProcessorConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W]: (x - 255 mean) / (255 std) in float32, torchvision's fused
    rescale + normalize. (image_processor.normalize rescales in float64 first, as the PIL image processor
    does; that differs in the last bit for some values, 0.19 on the fixture video's pixel sum.)"""
    mean = (np.asarray(cfg.mean, np.float32) * np.float32(255))[:, None, None]
    std = (np.asarray(cfg.std, np.float32) * np.float32(255))[:, None, None]
    return (np.moveaxis(pixels, -1, 0).astype(np.float32) - mean) / std


def preprocess_frames(frames: np.ndarray, cfg: VideoProcessorConfig,
                      timestamps: list[float] | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Sampled uint8 frames [T, H, W, 3] -> (patches float32 [T' * gh * gw, 3 * p * p], grid (T', gh, gw)),
    T' = T rounded up to even; timestamps (seconds) are drawn when cfg.draw_on_frames."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"frames must be a non-empty uint8 [T, H, W, 3] array, got {frames.dtype} {frames.shape}")
    frames = list(frames)
    if cfg.draw_on_frames:
        if timestamps is None or len(timestamps) != len(frames):
            raise ValueError("draw_on_frames needs one timestamp per frame")
        frames = [draw_timestamp(f, t, cfg.font) for f, t in zip(frames, timestamps)]
    if len(frames) % 2:
        frames.append(frames[-1])
    height, width = smart_resize(frames[0].shape[0], frames[0].shape[1], cfg.patch_size * cfg.merge_size,
                                 cfg.min_pixels, cfg.max_pixels)
    image_cfg = ImageProcessorConfig(cfg.patch_size, cfg.merge_size, 1)  # patchify's sizes, one frame per row
    gh, gw = height // cfg.patch_size, width // cfg.patch_size
    out = np.empty((len(frames) * gh * gw, 3 * cfg.patch_size**2), np.float32)
    for i, frame in enumerate(frames):
        pixels = normalize_frame(resize_frame(frame, height, width), cfg)
        out[i * gh * gw:(i + 1) * gh * gw] = patchify(pixels[None], image_cfg)[0]
    return out, (len(frames), gh, gw)


def read_video(data: bytes, cfg: VideoProcessorConfig, name: str = "the video"
               ) -> tuple[np.ndarray, list[int], list[float]]:
    """Decode the frames cfg samples: (uint8 [n, H, W, 3], their indices, their timestamps in seconds).
    Frames are decoded in order up to the last one sampled; only sampled ones are converted to RGB."""
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError) as e:
        raise ValueError(f"{name} could not be decoded as a video: {e}") from None
    with container:
        if not container.streams.video:
            raise ValueError(f"{name} has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise ValueError(f"{name} has no frame rate")
        video_fps, total = float(rate), stream.frames
        if total < 1:  # the container does not record it: count the packets instead
            total = sum(1 for packet in container.demux(stream) if packet.size)
            container.seek(0)
        indices = sample_frame_indices(total, video_fps, cfg)
        wanted, kept, last = set(indices), {}, None
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    kept[i] = frame.to_ndarray(format="rgb24")
                last = (i, frame)
                if i >= indices[-1]:
                    break
        except av.FFmpegError as e:
            raise ValueError(f"{name} could not be decoded: {e}") from None
        if last is None:
            raise ValueError(f"{name} has no decodable frames")
        if len(kept) < len(wanted):  # fewer frames than the container said: use the last one
            logger.warning("%s: frames %s are missing, using frame %d", name, sorted(wanted - set(kept)), last[0])
            kept.setdefault(last[0], last[1].to_ndarray(format="rgb24"))
            indices = [i if i in kept else last[0] for i in indices]
    # transformers: index / fps; FastDeploy: index * duration / frames
    seconds = [i / video_fps if cfg.sampling == "transformers" else i * (total / video_fps) / total
               for i in indices]
    return np.stack([kept[i] for i in indices]), indices, seconds


def process_video(source: VideoSource, cfg: VideoProcessorConfig, policy: MediaPolicy = TRUSTED) -> ProcessedVideo:
    """A video (bytes, a path, a file:// / data: / http(s) URL, or FastDeploy's dict {"video": <one of
    those>, "fps"/"min_frames"/"max_frames"/"target_frames"/"frames_sample": ...}) -> ProcessedVideo."""
    if isinstance(source, Mapping):
        options = dict(source)
        if "video" not in options:
            raise ValueError("a video dict needs a 'video' key with the bytes, path or URL")
        source = options.pop("video")
        cfg = cfg.for_request(options)
    name = "the video bytes" if isinstance(source, (bytes, bytearray, memoryview)) else str(source)[:100]
    frames, indices, seconds = read_video(read_bytes(source, policy), cfg, name)
    pixel_values, grid = preprocess_frames(frames, cfg, seconds)
    if len(indices) % 2:
        indices, seconds = indices + indices[-1:], seconds + seconds[-1:]
    return ProcessedVideo(pixel_values, grid, tuple(indices), tuple(seconds))
