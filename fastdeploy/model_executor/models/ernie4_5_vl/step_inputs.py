"""What the engine asks of ERNIE-4.5-VL, in plain values, so that it never reads the family's inputs itself:
- `placeholder_error`, per request: a prompt holding image / video placeholder ids without media is refused
  (the vision rows those tokens stand for would not exist);
- `chunk_inputs`, per step and request: the model's inputs for a chunk of the request's tokens besides the
  ids: [3, n] rotary positions (t, h, w), token types, and which of the prompt's vision rows the chunk's
  placeholders take.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastdeploy.model_executor.models.ernie4_5_vl.positions import TokenIds, text_positions
from fastdeploy.model_executor.multimodal import MultimodalInputs

ChunkInputs = tuple[np.ndarray, np.ndarray, tuple[int, int] | None]  # positions [3, n], types [n], vision rows


def placeholder_error(tokens: TokenIds, prompt_token_ids: Sequence[int], has_media: bool) -> str | None:
    """Why a prompt cannot run (None: it can): placeholder token ids and no media given with them."""
    if not has_media and {tokens.image, tokens.video} & set(prompt_token_ids):
        return ("the prompt holds image/video placeholder token ids but no media; pass the images/videos with "
                "the prompt text (multimodal_data, or content parts in chat)")
    return None


def chunk_inputs(mm: MultimodalInputs | None, prompt_token_ids: Sequence[int], begin: int, count: int) -> ChunkInputs:
    """The chunk of `count` tokens from sequence index `begin`: prompt tokens take the prepared positions and
    types; later tokens index + rope_delta on all axes, type 0; a text-only request (mm None) t = h = w.
    The vision rows [lo, hi) (prompt order) are the chunk's placeholders' ones; None when the chunk is past
    the prompt or earlier chunks took every row (an empty range while rows remain keeps them encoded)."""
    if mm is None:
        text = np.broadcast_to(np.arange(begin, begin + count, dtype=np.int64), (3, count))
        return text, np.zeros(count, np.int64), None
    num_prompt = len(prompt_token_ids)
    prompt_end = min(begin + count, num_prompt)
    pos, kinds = [mm.positions[:, begin:prompt_end]], [mm.token_types[begin:prompt_end]]
    if begin + count > prompt_end:
        first = max(begin, num_prompt)
        pos.append(text_positions(first, begin + count - first, mm.rope_delta))
        kinds.append(np.zeros(begin + count - first, np.int64))
    rows = None
    if begin < num_prompt:
        placeholders = np.isin(np.asarray(prompt_token_ids[:prompt_end]), mm.placeholder_ids)
        lo, hi = int(placeholders[:begin].sum()), int(placeholders.sum())
        if lo < mm.num_vision_rows:  # also a text-only chunk before more media: keeps its rows encoded
            rows = (lo, hi)
    return np.concatenate(pos, axis=1), np.concatenate(kinds), rows
