"""A prepared multimodal prompt as plain data: what the engine keeps with a request, the entrypoints hand
over and the step builder reads. The model family's request side makes it (models/ernie4_5_vl/
processor.py) and the family's step_inputs.py reads it per step; holding one needs neither (this module
imports numpy only), so the engine and the entrypoints import it, not the processor.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class MultimodalInputs:
    """A prepared multimodal prompt. `pixel_values` holds the images' patches then the videos'; the vision
    rows the encoder makes from them are reordered to prompt order with `row_order`."""

    positions: np.ndarray  # [3, S] int64
    token_types: np.ndarray  # [S] int64
    rope_delta: int
    pixel_values: np.ndarray  # float32 [patches, 3 * 14 * 14]
    grid_thw: list[tuple[int, int, int]]  # images then videos
    row_order: np.ndarray  # [placeholders] int64: encoder row of each placeholder, in prompt order
    num_image_tokens: int
    num_video_tokens: int
    content_hash: bytes  # SHA-256 of the pixels and grids; all the block manager reads (prefix-cache keys)
    placeholder_ids: tuple[int, int]  # image, video placeholder token ids

    @property
    def num_vision_rows(self) -> int:
        return int(self.row_order.size)
