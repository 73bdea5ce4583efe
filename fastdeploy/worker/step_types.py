"""What crosses the boundary between the engine and the model runner each step: plain arrays in
(`SchedulerOutput`), plain arrays out (`ModelRunnerOutput`). The runner never sees a request."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fastdeploy.ops.sampling_reference import SamplingBatch


@dataclass(slots=True)
class VisionSlice:
    """One multimodal request's vision rows needed by this step: its media (encoded once by the runner, kept
    under `key` until the last row is used) and the placeholder rows [lo, hi) of this step's chunk."""

    key: str
    pixel_values: np.ndarray  # float32 [patches, 3 * 14 * 14], images then videos
    grid_thw: list[tuple[int, int, int]]
    row_order: np.ndarray  # int64 [placeholders]: encoder row of each placeholder in prompt order
    lo: int
    hi: int


@dataclass(slots=True)
class ForwardBatch:
    """The step's ragged batch, request after request: what every tensor-parallel rank runs. The
    forward context (slot mapping, query starts, padded block tables) is derived from it per rank."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64, or [3, T] (t, h, w) for a multimodal step
    query_lens: np.ndarray  # [B] int64: new tokens per request
    context_lens: np.ndarray  # [B] int64: tokens per request once this step's are added
    block_tables: np.ndarray  # [B, max_blocks] int64: KV blocks of each request, zero-padded
    logit_rows: np.ndarray  # [S + P] int64: hidden-state rows whose logits are needed: S samples, then P prompt rows
    # Multimodal steps (some request has media): positions are [3, T], token types [T] (0 text, 1 image,
    # 2 video) and the vision rows of the chunk's placeholders, request after request.
    token_types: np.ndarray | None = None
    vision: list[VisionSlice] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One step for the runner. The first S logit rows sample a token (one per request that catches up
    with its known tokens this step, in batch order); the P rows after them give prompt logprobs."""

    forward: ForwardBatch
    sampling: SamplingBatch  # S rows, values validated when the requests were made
    forced_token_ids: np.ndarray  # [S] int64: emitted instead of the sampled token; -1: none; empty: no row forced
    bias_rows: np.ndarray  # logit_bias as coordinates: add bias_values at (bias_rows, bias_token_ids)
    bias_token_ids: np.ndarray
    bias_values: np.ndarray  # float32
    logprob_rows: np.ndarray  # int64 indices into the S rows that want the logprobs of their token
    logprob_k: np.ndarray  # int64, per logprob row: how many top entries (-1: the whole vocabulary)
    prompt_logprob_k: np.ndarray  # [P] int64
    prompt_logprob_targets: np.ndarray  # [P] int64: the prompt token that follows each prompt row
    # Grammar-constrained rows (guided decoding): indices into the S rows and, per such row, the allowed
    # tokens as bits (token t: bit t % 32 of int32 word t // 32). The engine may still be filling the
    # bitmask while the forward runs; ModelRunner.execute waits for it before sampling.
    guided_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    token_bitmask: np.ndarray | None = None  # int32 [len(guided_rows), words]
    # Per logprob row (float32): the temperature its logits are divided by before the log-softmax
    # (temp_scaled_logprobs; 1: raw) and the top_p nucleus they are renormalised to
    # (top_p_normalized_logprobs; 1: none). Empty: all raw.
    logprob_temperature: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    logprob_top_p: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    @property
    def num_samples(self) -> int:
        return len(self.sampling)


@dataclass(slots=True)
class TopLogprobs:
    """One position's log-probabilities (raw log-softmax of the logits): the k best, and the target's."""

    token_ids: np.ndarray  # int64 [k], best first
    logprobs: np.ndarray  # float32 [k]
    target_logprob: float
    target_rank: int  # 1-based rank in the vocabulary


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: list[int]  # [S]
    logprobs: list[TopLogprobs] = field(default_factory=list)  # one per SchedulerOutput.logprob_rows entry
    prompt_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per prompt row
