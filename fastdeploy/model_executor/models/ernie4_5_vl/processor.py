"""ERNIE-4.5-VL request preparation: media of a chat conversation or of `multimodal_data` -> pixel values
and grids, the prompt with each image / video placeholder expanded to one placeholder token per merged
token (image t*h*w/4, video t*h*w/8), token types, 3-D positions and rope_delta, and a content hash of the
pixels for prefix caching. Everything here runs on the engine side; the runner only encodes the pixels.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fastdeploy.input.media import TRUSTED, MediaPolicy, load_image
from fastdeploy.input.tokenizer import Tokenizer
from fastdeploy.model_executor.models.ernie4_5_vl.image_processor import ImageProcessorConfig, preprocess_image
from fastdeploy.model_executor.models.ernie4_5_vl.positions import item_tokens, prompt_positions, token_types
from fastdeploy.model_executor.models.ernie4_5_vl.video_processor import (
    VideoProcessorConfig, preprocess_frames, process_video)
from fastdeploy.model_executor.multimodal import MultimodalInputs

logger = logging.getLogger(__name__)

# Placeholder markers a rendered prompt may hold: transformers' / this project's template and Baidu's.
IMAGE_MARKERS = ("<|IMAGE_PLACEHOLDER|>", "<|image@placeholder|>")
VIDEO_MARKERS = ("<|VIDEO_PLACEHOLDER|>", "<|video@placeholder|>")
_MARKER = re.compile("|".join(re.escape(m) for m in IMAGE_MARKERS + VIDEO_MARKERS))
MM_PROCESSOR_KEYS = ("image_min_pixels", "image_max_pixels", "video_min_pixels", "video_max_pixels", "video_fps",
                     "video_min_frames", "video_max_frames", "video_target_frames")


@dataclass(slots=True)
class MediaProcessor:
    """Per-LLM media settings: image / video processor configs, limit_mm_per_prompt and the MediaPolicy
    media are read under."""

    image_cfg: ImageProcessorConfig
    video_cfg: VideoProcessorConfig
    limits: dict[str, int]
    policy: MediaPolicy = TRUSTED

    @classmethod
    def from_pretrained(cls, directory: str | Path, limit_mm_per_prompt: Mapping[str, int] | None = None,
                        mm_processor_kwargs: Mapping[str, Any] | None = None,
                        policy: MediaPolicy = TRUSTED) -> MediaProcessor:
        """limit_mm_per_prompt None: the policy's default limits (the server's), if any."""
        kwargs = dict(mm_processor_kwargs or {})
        unknown = sorted(set(kwargs) - set(MM_PROCESSOR_KEYS))
        if unknown:
            raise NotImplementedError(f"mm_processor_kwargs {unknown} are not supported; supported keys: "
                                      f"{list(MM_PROCESSOR_KEYS)}")
        image = {k.removeprefix("image_"): v for k, v in kwargs.items() if k.startswith("image_")}
        video = {k.removeprefix("video_"): v for k, v in kwargs.items() if k.startswith("video_")}
        return cls(ImageProcessorConfig.from_pretrained(directory, **image),
                   VideoProcessorConfig.from_pretrained(directory, **video),
                   dict(limit_mm_per_prompt if limit_mm_per_prompt is not None else policy.limit_mm_per_prompt or {}),
                   policy)

    def check_limits(self, images: int, videos: int) -> None:
        for kind, count in (("image", images), ("video", videos)):
            limit = self.limits.get(kind)
            if limit is not None and count > limit:
                raise ValueError(f"the prompt has {count} {kind}s, more than limit_mm_per_prompt[{kind!r}]={limit}")

    def image(self, source: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        patches, grid = preprocess_image(load_image(source, self.policy), self.image_cfg)
        return patches, tuple(int(v) for v in grid)

    def video(self, source: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """bytes / path / URL / FastDeploy's dict {"video": ..., "fps", "max_frames", ...} through the decoder,
        or pre-decoded frames: a uint8 [T, H, W, 3] array or a list of PIL images (no timestamps drawn)."""
        frames = source
        if isinstance(source, (list, tuple)) and source and all(isinstance(f, Image.Image) for f in source):
            frames = np.stack([np.asarray(f.convert("RGB")) for f in source])
        if isinstance(frames, np.ndarray):
            patches, grid = preprocess_frames(frames, dataclasses.replace(self.video_cfg, draw_on_frames=False))
        else:
            if isinstance(source, Mapping):
                self.policy.check_video_options(source)
            video = process_video(source, self.video_cfg, self.policy)
            patches, grid = video.pixel_values, video.grid_thw
        return patches, tuple(int(v) for v in grid)


def media_of_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[Any], list[Any]]:
    """(images, videos) of a conversation's content parts in order: {"type": "image_url", "image_url": {"url":
    ...}} (or a plain string), {"type": "image", "image": ...} and the video forms alike."""
    images: list[Any] = []
    videos: list[Any] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in ("image_url", "video_url"):
                value = part.get(kind)
                value = value.get("url") if isinstance(value, Mapping) else value
                if value is None:
                    raise ValueError(f"a {kind!r} content part needs {{'url': ...}}")
                (images if kind == "image_url" else videos).append(value)
            elif kind in ("image", "video"):
                value = part.get(kind, part.get("url"))
                if value is None:
                    raise ValueError(f"a {kind!r} content part needs the {kind!r} key")
                (images if kind == "image" else videos).append(value)
    return images, videos


def _content_hash(pixels: list[np.ndarray], grids: list[tuple[int, int, int]]) -> bytes:
    digest = hashlib.sha256()
    for p, g in zip(pixels, grids):
        digest.update(repr(g).encode())
        digest.update(np.ascontiguousarray(p, dtype=np.float32).tobytes())
    return digest.digest()


def prepare(tokenizer: Tokenizer, tokens: Any, processor: MediaProcessor, prompt: str, images: Sequence[Any],
            videos: Sequence[Any]) -> tuple[list[int], MultimodalInputs | None]:
    """(expanded token ids, MultimodalInputs) of a rendered prompt and its media; ValueError when the
    placeholders and the media do not match in number. Without media: plain encoding, no inputs."""
    processor.check_limits(len(images), len(videos))
    markers = _MARKER.findall(prompt)
    n_img = sum(m in IMAGE_MARKERS for m in markers)
    if n_img != len(images) or len(markers) - n_img != len(videos):
        raise ValueError(f"the prompt has {n_img} image and {len(markers) - n_img} video placeholders but "
                         f"{len(images)} images and {len(videos)} videos were given")
    if not markers:
        return tokenizer.encode(prompt, add_special_tokens=False), None
    image_items = [processor.image(s) for s in images]
    video_items = [processor.video(s) for s in videos]
    image_tok, video_tok = tokenizer.convert_ids_to_tokens([tokens.image, tokens.video])
    counts = iter([item_tokens(g, False) for _, g in image_items])
    vcounts = iter([item_tokens(g, True) for _, g in video_items])
    expanded = _MARKER.sub(lambda m: image_tok * next(counts) if m.group(0) in IMAGE_MARKERS
                           else video_tok * next(vcounts), prompt)
    ids = tokenizer.encode(expanded, add_special_tokens=False)
    grids_i = [g for _, g in image_items]
    grids_v = [g for _, g in video_items]
    positions, delta = prompt_positions(ids, tokens, grids_i, grids_v)
    types = token_types(ids, tokens)
    arr = np.asarray(ids)
    kinds = types[np.isin(arr, [tokens.image, tokens.video])]
    n_image_rows = int((kinds == 1).sum())
    order = np.empty(kinds.size, np.int64)
    order[kinds == 1] = np.arange(n_image_rows)
    order[kinds == 2] = n_image_rows + np.arange(kinds.size - n_image_rows)
    pixels = [p for p, _ in image_items + video_items]
    grids = grids_i + grids_v
    return ids, MultimodalInputs(positions, types, delta, np.concatenate(pixels).astype(np.float32), grids, order,
                                 n_image_rows, kinds.size - n_image_rows, _content_hash(pixels, grids),
                                 (tokens.image, tokens.video))


def _as_list(value: Any, name: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)) and not (value and all(isinstance(v, (int, float)) for v in value)):
        return list(value)
    if isinstance(value, np.ndarray) and value.ndim == 4:
        return [value]  # one video of pre-decoded frames
    if isinstance(value, (list, tuple)):
        raise TypeError(f"multimodal_data[{name!r}] must be a list of {name}s")
    return [value]


def multimodal_data_media(data: Any) -> tuple[list[Any], list[Any]]:
    """(images, videos) of a prompt dict's `multimodal_data` {"image": [...], "video": [...]}."""
    if not isinstance(data, Mapping):
        raise TypeError(f"multimodal_data must be a dict like {{'image': [...], 'video': [...]}}, got "
                        f"{type(data).__name__}")
    unknown = sorted(set(data) - {"image", "video"})
    if unknown:
        raise ValueError(f"multimodal_data keys must be among ['image', 'video'], got {unknown}")
    return _as_list(data.get("image"), "image"), _as_list(data.get("video"), "video")
