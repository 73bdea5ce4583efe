"""ERNIE-4.5-VL's per-token inputs besides the ids: token types (which expert set a token uses) and the
3-D rotary positions (t, h, w), as transformers' Ernie4_5_VLMoeModel.get_rope_index computes them.

For a prompt (ids with each image / video expanded to one placeholder per merged token):
- `token_types`: 1 for image placeholders and `<|IMAGE_START|>` / `<|IMAGE_END|>`, 2 for the video ones,
  0 otherwise (transformers' `moe_mm_token_type_ids`: the MoE routes 1 and 2 to the vision experts).
- `prompt_positions`: text counts up on all three axes from `cur`; an item starting at `cur` gives its
  token (i, a, b) (temporal step, merged row, merged column) the positions (cur + i, cur + a, cur + b),
  then `cur += max(merged rows, merged columns)`. Start / end tokens are text here. Temporal steps: 1 per
  image, frames / temporal_merge_size per video. rope_delta = max position + 1 - len(ids).
- Every later token (generated, or appended text) at sequence index i has position i + rope_delta on all
  three axes (`text_positions`).
Placeholder runs are split into items by their token counts, in the order the grids are given (images
and videos each in prompt order); transformers would take two adjacent items with no token between them
for one. `rope_delta` is transformers' rule; FastDeploy continues at max position + 1 instead, which
differs only when a video's temporal extent exceeds its spatial one.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

Grid = Sequence[Sequence[int]]  # (t, h, w) in patches, per item


class TokenIds(Protocol):
    """The special token ids (config.VLTokenIds has these fields)."""

    image: int
    image_start: int
    image_end: int
    video: int  # may equal `image`: then the enclosing start token tells the modality
    video_start: int
    video_end: int


def token_types(input_ids: Sequence[int] | np.ndarray, tokens: TokenIds) -> np.ndarray:
    """[S] int64: 0 text, 1 image (placeholders, start, end), 2 video (likewise)."""
    ids = np.asarray(input_ids, dtype=np.int64)
    types = np.zeros(ids.shape, dtype=np.int64)
    types[np.isin(ids, [tokens.image, tokens.image_start, tokens.image_end])] = 1
    types[np.isin(ids, [tokens.video, tokens.video_start, tokens.video_end])] = 2
    if tokens.video == tokens.image:  # one placeholder id: the last start token before it decides
        starts = np.where(np.isin(ids, [tokens.image_start, tokens.video_start]), np.arange(ids.size), -1)
        last = np.maximum.accumulate(starts) if ids.size else starts
        opened_video = (last >= 0) & (ids[np.maximum(last, 0)] == tokens.video_start)
        placeholder = ids == tokens.image
        types[placeholder] = np.where(opened_video[placeholder], 2, 1)
    return types


def item_tokens(grid: Sequence[int], video: bool, spatial_merge_size: int = 2, temporal_merge_size: int = 2) -> int:
    """Placeholder tokens of one item with patch grid (t, h, w)."""
    t, h, w = (int(v) for v in grid)
    return (t // temporal_merge_size if video else t) * (h // spatial_merge_size) * (w // spatial_merge_size)


def prompt_positions(input_ids: Sequence[int] | np.ndarray, tokens: TokenIds, image_grid_thw: Grid | None = None,
                     video_grid_thw: Grid | None = None, spatial_merge_size: int = 2,
                     temporal_merge_size: int = 2) -> tuple[np.ndarray, int]:
    """(positions [3, S] int64 (t, h, w), rope_delta) of a whole prompt; ValueError when the placeholders
    and the grids do not match."""
    ids = np.asarray(input_ids, dtype=np.int64)
    if ids.ndim != 1 or not ids.size:
        raise ValueError("input_ids must be a non-empty sequence of token ids")
    types = token_types(ids, tokens)
    placeholder = np.where(np.isin(ids, [tokens.image, tokens.video]), types, 0)
    grids = {1: [tuple(int(v) for v in g) for g in (image_grid_thw or [])],
             2: [tuple(int(v) for v in g) for g in (video_grid_thw or [])]}
    used = {1: 0, 2: 0}
    out = np.empty((3, ids.size), dtype=np.int64)
    cur, i = 0, 0
    while i < ids.size:
        kind = int(placeholder[i])
        if kind == 0:  # a text run up to the next placeholder
            nxt = np.flatnonzero(placeholder[i:])
            end = i + int(nxt[0]) if nxt.size else ids.size
            out[:, i:end] = cur + np.arange(end - i)
            cur, i = cur + end - i, end
            continue
        name = "image" if kind == 1 else "video"
        if used[kind] == len(grids[kind]):
            raise ValueError(f"more {name} placeholder runs than {name} grids ({len(grids[kind])}) at token {i}")
        t, h, w = grids[kind][used[kind]]
        used[kind] += 1
        n = item_tokens((t, h, w), kind == 2, spatial_merge_size, temporal_merge_size)
        if not np.all(placeholder[i:i + n] == kind) or i + n > ids.size:
            raise ValueError(f"{name} {used[kind] - 1} (grid {(t, h, w)}) needs {n} consecutive placeholder "
                             f"tokens from token {i}")
        steps = t // temporal_merge_size if kind == 2 else t
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        grid = np.meshgrid(np.arange(steps), np.arange(rows), np.arange(cols), indexing="ij")
        out[:, i:i + n] = cur + np.stack([g.reshape(-1) for g in grid])
        cur, i = cur + max(rows, cols), i + n
    for kind, name in ((1, "image"), (2, "video")):
        if used[kind] != len(grids[kind]):
            raise ValueError(f"{len(grids[kind])} {name} grids but {used[kind]} {name} placeholder runs")
    return out, int(out.max()) + 1 - ids.size


def text_positions(first_index: int, count: int, rope_delta: int) -> np.ndarray:
    """[3, count] positions of tokens at sequence indices first_index .. first_index + count - 1 after the
    prompt's last item (decode tokens): index + rope_delta on every axis."""
    return np.broadcast_to(np.arange(first_index, first_index + count, dtype=np.int64) + rope_delta,
                           (3, count)).copy()
