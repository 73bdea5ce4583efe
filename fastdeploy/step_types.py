"""What crosses the boundary between the engine and the model runner each step: plain arrays in
(`SchedulerOutput`, with its `ForwardBatch` and `SamplingBatch`), plain arrays out (`ModelRunnerOutput`).
The runner never sees a request.

Any layer may import this module (the engine builds these, the worker and the sampling package read
them, the output processor reads `TopLogprobs`), so it imports nothing from fastdeploy: numpy only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

GREEDY_TEMPERATURE = 1e-5  # below this temperature a row is greedy (vLLM's epsilon)
_PARAM_CHECKS = (
    ("temperature", lambda a: np.isfinite(a) & (a >= 0), ">= 0"),
    ("top_p", lambda a: (a >= 0) & (a <= 1), "in [0, 1]"),
    ("top_k", lambda a: a >= -1, "-1, 0 (off) or >= 1"),
    ("min_p", lambda a: (a >= 0) & (a <= 1), "in [0, 1]"),
    ("repetition_penalty", lambda a: np.isfinite(a) & (a > 0), "> 0"),
    ("frequency_penalty", np.isfinite, "finite"),
    ("presence_penalty", np.isfinite, "finite"),
)


def greedy_rows(temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Which rows take the argmax instead of drawing (arrays, or one row's plain values)."""
    return (temperature < GREEDY_TEMPERATURE) | (top_p <= 0) | (top_k == 1)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling inputs of one step. Trusted as they are: SamplingParams validated the values
    when the request was made (`from_lists` validates its own)."""

    temperature: np.ndarray  # float32 [B]; 0 => greedy
    top_p: np.ndarray  # float32 [B]; 1 => off; 0 => greedy
    top_k: np.ndarray  # int64 [B]; 0 or -1 => off; 1 => greedy
    min_p: np.ndarray  # float32 [B]; 0 => off
    repetition_penalty: np.ndarray  # float32 [B]; 1 => off; over prompt and output tokens
    frequency_penalty: np.ndarray  # float32 [B]; over output tokens
    presence_penalty: np.ndarray  # float32 [B]; over output tokens
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    banned_token_ids: list[Sequence[int]]  # set to -inf this step (EOS/stop ids below min_tokens)
    uniforms: np.ndarray  # float64 [B] in [0, 1): where each sampled row inverts its CDF (greedy: unread)
    # What greedy_mask(), plain_greedy() and untouched_logits() answer, when the caller already knows (the
    # scheduler does as it builds the rows); None: computed from the arrays.
    greedy: np.ndarray | None = None
    plain: bool | None = None
    untouched: bool | None = None

    def __len__(self) -> int:
        return len(self.temperature)

    def greedy_mask(self) -> np.ndarray:
        return greedy_rows(self.temperature, self.top_p, self.top_k) if self.greedy is None else self.greedy

    def plain_greedy(self) -> bool:
        """Every row is greedy on logits nothing changes: the tokens are a bare argmax."""
        if self.plain is not None:
            return self.plain
        return bool(self.greedy_mask().all()) and self.untouched_logits()

    def untouched_logits(self) -> bool:
        """No row bans a token or applies a penalty (each penalty is off or has no tokens to act on)."""
        if self.untouched is not None:
            return self.untouched
        if any(len(ids) for ids in self.banned_token_ids):
            return False
        outputs = np.array([len(ids) > 0 for ids in self.output_token_ids], dtype=bool)
        context = outputs | np.array([len(ids) > 0 for ids in self.prompt_token_ids], dtype=bool)
        return not (((self.repetition_penalty != 1) & context).any()
                    or (((self.frequency_penalty != 0) | (self.presence_penalty != 0)) & outputs).any())

    @classmethod
    def from_lists(
        cls,
        batch_size: int,
        *,
        temperature: float | Sequence[float] = 1.0,
        top_p: float | Sequence[float] = 1.0,
        top_k: int | Sequence[int] = 0,
        min_p: float | Sequence[float] = 0.0,
        repetition_penalty: float | Sequence[float] = 1.0,
        frequency_penalty: float | Sequence[float] = 0.0,
        presence_penalty: float | Sequence[float] = 0.0,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
        seeds: Sequence[int | None] | None = None,
        generators: Sequence[np.random.Generator | None] | None = None,
        uniforms: Sequence[float] | None = None,
    ) -> SamplingBatch:
        """A validated batch from scalars (shared by all rows) or per-row lists.

        Each sampled row draws its uniform now from its generator: `generators`, or
        `np.random.default_rng(seed)` per `seeds` (a None seed: fresh OS entropy); greedy rows draw
        nothing and may have a None generator. Or `uniforms` gives them.
        """

        def arr(value: object, dtype: type, name: str) -> np.ndarray:
            a = np.asarray(value, dtype=dtype)
            a = np.full(batch_size, a, dtype=dtype) if a.ndim == 0 else a
            if a.shape != (batch_size,):
                raise ValueError(f"{name} must be a scalar or a list of {batch_size} values")
            return a

        def seqs(value: Sequence[Sequence[int]] | None, name: str) -> list[Sequence[int]]:
            out = [[] for _ in range(batch_size)] if value is None else list(value)
            if len(out) != batch_size:
                raise ValueError(f"{name} must have {batch_size} rows, got {len(out)}")
            return out

        columns = dict(temperature=arr(temperature, np.float32, "temperature"), top_p=arr(top_p, np.float32, "top_p"),
                       top_k=arr(top_k, np.int64, "top_k"), min_p=arr(min_p, np.float32, "min_p"),
                       repetition_penalty=arr(repetition_penalty, np.float32, "repetition_penalty"),
                       frequency_penalty=arr(frequency_penalty, np.float32, "frequency_penalty"),
                       presence_penalty=arr(presence_penalty, np.float32, "presence_penalty"))
        for name, ok, allowed in _PARAM_CHECKS:
            good = ok(columns[name])
            if not good.all():
                row = int(np.argmin(good))
                raise ValueError(f"{name} of row {row} is {columns[name][row]}; allowed: {allowed}")
        if uniforms is not None:
            u = arr(uniforms, np.float64, "uniforms")
            if not ((u >= 0) & (u < 1)).all():
                raise ValueError("uniforms must be in [0, 1)")
        else:
            u = _draw_uniforms(columns, batch_size, seeds, generators)
        return cls(**columns, prompt_token_ids=seqs(prompt_token_ids, "prompt_token_ids"),
                   output_token_ids=seqs(output_token_ids, "output_token_ids"),
                   banned_token_ids=seqs(banned_token_ids, "banned_token_ids"), uniforms=u)


def _draw_uniforms(columns: dict[str, np.ndarray], batch_size: int, seeds: Sequence[int | None] | None,
                   generators: Sequence[np.random.Generator | None] | None) -> np.ndarray:
    """One uniform per sampled row from its own generator, in row order; 0 for greedy rows."""
    if generators is None:
        seed_list = [None] * batch_size if seeds is None else list(seeds)
        if len(seed_list) != batch_size:
            raise ValueError(f"seeds must have {batch_size} values, got {len(seed_list)}")
        generators = [np.random.default_rng(s) for s in seed_list]
    if len(generators) != batch_size:
        raise ValueError(f"generators must have {batch_size} rows, got {len(generators)}")
    sampled = np.flatnonzero(~greedy_rows(columns["temperature"], columns["top_p"], columns["top_k"]))
    missing = [int(i) for i in sampled if generators[i] is None]
    if missing:
        raise ValueError(f"generators of sampled rows {missing} are None; only greedy rows may omit one")
    uniforms = np.zeros(batch_size, dtype=np.float64)
    uniforms[sampled] = [generators[i].random() for i in sampled]
    return uniforms


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
    # Rows whose final-normed hidden states the step hands back (MTP drafting reads them); empty: none.
    hidden_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass(slots=True)
class MtpRows:
    """The requests of a step that feed ERNIE-4.5's MTP layer (speculative.py's "mtp"), in batch order. Each one's
    rows are in ForwardBatch.hidden_rows (all its query rows, request after request); after sampling, the runner
    runs the MTP layer over those whose main-model hidden state is final (worker/mtp_proposer.py)."""

    batch_index: np.ndarray  # int64 [M]: the request's index in the forward batch
    num_drafts: np.ndarray  # int64 [M]: how many of its query tokens (the last ones) are drafts to verify
    first_sample: np.ndarray  # int64 [M]: its first sampling row, or -1 for a prompt chunk that does not sample
    next_token: np.ndarray  # int64 [M]: for such a chunk, the prompt token after it (else unread)
    draft_limit: np.ndarray  # int64 [M]: tokens to draft for its next step (0: only the MTP cache is filled)
    logprobs_k: np.ndarray  # int64 [M]: top entries of each draft's logprobs to hand back (-1: none asked)


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
    mtp: MtpRows | None = None

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
    draft_token_ids: list[list[int]] = field(default_factory=list)  # per MtpRows entry, its next step's drafts
    draft_logprobs: list[list[TopLogprobs]] = field(default_factory=list)  # per entry, its drafts' (logprobs_k)


def block_table_array(tables: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """int64 [B, widest table] of the requests' block tables, zero-padded (such an array: itself)."""
    if isinstance(tables, np.ndarray) and tables.ndim == 2 and tables.dtype == np.int64:
        return tables
    width = max(max(map(len, tables), default=0), 1)
    if all(len(t) == width for t in tables):
        return np.array(tables, dtype=np.int64).reshape(len(tables), width)
    out = np.zeros((len(tables), width), dtype=np.int64)
    for b, table in enumerate(tables):
        out[b, :len(table)] = table
    return out
