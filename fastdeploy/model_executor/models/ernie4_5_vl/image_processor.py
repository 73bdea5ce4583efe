"""ERNIE-4.5-VL image preprocessing: PIL image -> the vision tower's flattened patches and grid.

Same results as transformers' Ernie4_5_VLMoeImageProcessorPil (tested against it):
1. RGB, transparency composited onto white;
2. resize (bicubic, on the uint8 image) to the size `smart_resize` picks: both sides multiples of
   patch_size x merge_size (28), the area within [min_pixels, max_pixels], the aspect ratio kept as
   closely as that allows;
3. scale to [0, 1] (in float64, then float32) and normalise per channel with the CLIP mean / std;
4. cut into patch_size x patch_size patches ordered so that each merge_size x merge_size block of
   patches is contiguous (block rows, block columns, then the patches inside a block), each patch
   flattened channel-major: [grid_h * grid_w, channels * temporal_patch_size * patch_size**2].
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True)
class ImageProcessorConfig:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 1  # images repeat each patch this many times (videos use 2 frames per patch)
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 6177
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], **overrides: int) -> ImageProcessorConfig:
        """From the checkpoint's preprocessor_config.json (transformers' `size` or the original
        `min_pixels` / `max_pixels`), with `overrides` (e.g. min_pixels/max_pixels) on top."""
        path = Path(directory) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        size, default = raw.get("size") or {}, cls()
        values = {
            "patch_size": raw.get("patch_size", default.patch_size),
            "merge_size": raw.get("merge_size", default.merge_size),
            "temporal_patch_size": raw.get("temporal_patch_size") or default.temporal_patch_size,
            "min_pixels": raw.get("min_pixels", size.get("shortest_edge", default.min_pixels)),
            "max_pixels": raw.get("max_pixels", size.get("longest_edge", default.max_pixels)),
            "mean": tuple(raw.get("image_mean", CLIP_MEAN)),
            "std": tuple(raw.get("image_std", CLIP_STD)),
        }
        unknown = sorted(set(overrides) - {"min_pixels", "max_pixels"})
        if unknown:
            raise ValueError(f"image processor options must be among ['max_pixels', 'min_pixels'], got {unknown}")
        values.update(overrides)
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            if isinstance(values[name], bool) or not isinstance(values[name], int) or values[name] < 1:
                raise ValueError(f"{name} must be a positive int, got {values[name]!r}")
        if values["min_pixels"] > values["max_pixels"]:
            raise ValueError(f"min_pixels ({values['min_pixels']}) must not exceed max_pixels ({values['max_pixels']})")
        return cls(**values)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `factor`, area in [min, max] pixels."""
    if min(height, width) < 1:
        raise ValueError(f"the image is empty ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"the image's aspect ratio must be below {MAX_ASPECT_RATIO}, got {width}x{height}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def normalize(pixels: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W], scaled to [0, 1] and normalised."""
    scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    chw = np.moveaxis(scaled, -1, 0)
    return (chw - np.asarray(cfg.mean, np.float32)[:, None, None]) / np.asarray(cfg.std, np.float32)[:, None, None]


def patchify(frames: np.ndarray, cfg: ImageProcessorConfig) -> tuple[np.ndarray, int, int]:
    """float32 [T, 3, H, W] (T = temporal_patch_size frames) -> patches [gh * gw, 3 * T * p * p], gh, gw."""
    t, c, height, width = frames.shape
    p, m = cfg.patch_size, cfg.merge_size
    gh, gw = height // p, width // p
    x = frames.reshape(t, c, gh // m, m, p, gw // m, m, p)
    # -> block row, block column, row in block, column in block, channel, frame, pixel row, pixel column
    x = x.transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return np.ascontiguousarray(x).reshape(gh * gw, c * t * p * p), gh, gw


def preprocess_image(image: Image.Image, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (patches float32 [gh * gw, 3 * temporal_patch_size * p * p], grid (1, gh, gw))."""
    rgb = to_rgb(image)
    h, w = smart_resize(rgb.height, rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if (h, w) != (rgb.height, rgb.width):
        rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
    frame = normalize(np.asarray(rgb), cfg)
    frames = np.broadcast_to(frame, (cfg.temporal_patch_size, *frame.shape))
    patches, gh, gw = patchify(frames, cfg)
    return patches, (1, gh, gw)
