"""A scheduled step as arrays: `build_step` turns the requests the scheduler chose, and their new-token
counts, into the runner's SchedulerOutput (the ragged batch, each sampling row's parameters, drawn
uniforms, bans, bias and forced tokens: every decision of a request's policy is made here, on the engine
side), kept with the requests in a ScheduledStep for the scheduler's update after the step.

`SteadyDecode` makes the next step of a plain decoding batch by moving the last one on by a token instead.
While a batch only decodes, every request one new token sampled with nothing but its sampling policy (no
bans, bias, logprobs, forced tokens, grammar or media: `plain_decoder` for the requests,
sampling.policy.sampler_alone for the step), a step differs from the last by one token per request: the ids,
positions and context lengths move on, a block table gains a block now and then and the sampled rows draw
new uniforms. So the scheduler keeps such a step and, when it schedules the same requests the same way
again, updates that step's arrays in place instead of building them anew (vLLM's persistent batch, in
small). At one stream building a step was ~0.1 ms, most of the scheduler's time per token. A speculative step
that verifies drafts of the same requests is built anew but leaves the kept step for the plain steps after it
(their block tables read afresh: the drafts may have crossed blocks).

The kept step is handed to the runner again, so its arrays are read-only to everyone else (SteadyDecode writes
through views it made before; a write anywhere else raises), and nothing may keep them past the step as that
step's values: the runner reads them during `execute`, the compiled step reads them afresh at every call and
the tensor-parallel workers get copies.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.request import Request
from fastdeploy.model_executor.models.ernie4_5_vl.step_inputs import chunk_inputs
from fastdeploy.sampling import policy as sampling_policy
from fastdeploy.sampling.policy import sampler_alone
from fastdeploy.step_types import (ForwardBatch, MtpRows, SamplingBatch, SchedulerOutput, VisionSlice,
                                   greedy_rows)


@dataclass(slots=True)
class ScheduledStep:
    """One step as the engine sees it: the requests and their new-token counts, which of them sample
    (the runner's sampling rows, in order) and which prompt positions give logprobs, and the
    SchedulerOutput handed to the runner."""

    requests: list[Request]
    num_new_tokens: list[int]
    samplers: list[Request]
    prompt_rows: list[tuple[Request, int]]  # (request, prompt position) per prompt-logprob row
    model_input: SchedulerOutput
    rows: list[Request]  # the request of each sampling row: the samplers, a drafting one once per position
    emitted: list[list[int]] = field(default_factory=list)  # per sampler, its tokens (set by update_from_output)
    draft_logprobs: list[list] = field(default_factory=list)  # per sampler, its accepted MTP drafts' TopLogprobs


def sampling_batch(requests: list[Request], offsets: list[int] | None = None) -> SamplingBatch:
    """The sampling rows of `requests` (one per row; a drafting request has one per draft after its first):
    sampling/policy.py builds them from each request's parameters, prompt and output ids, bans and uniforms
    (its docstring says what is decided there). A row `offsets[i]` positions past its request's output sees
    the drafts before it as output: penalties and bad words count them, min_tokens bans by its position, and
    it has that position's uniform."""
    if offsets is not None and all(map(_argmax_row, requests, offsets)):
        return _argmax_batch(len(requests))
    if offsets is None or not any(offsets):
        outputs = [r.output_token_ids for r in requests]
        below = [r.below_min_tokens for r in requests]
        offsets = [0] * len(requests)
    else:
        outputs = [r.output_token_ids + r.draft_token_ids[:j] for r, j in zip(requests, offsets)]
        below = [r.num_output_tokens + j < r.params.min_tokens for r, j in zip(requests, offsets)]
    banned = [sampling_policy.banned_tokens(output, r.bad_words, b, r.eos_token_ids, r.params.stop_token_ids)
              for r, output, b in zip(requests, outputs, below)]
    return sampling_policy.sampling_batch([r.params for r in requests], [r.prompt_token_ids for r in requests],
                                          outputs, banned, lambda i: requests[i].uniform(offsets[i]))


def _argmax_row(request: Request, offset: int) -> bool:
    """Whether the row takes the argmax of logits nothing changes (greedy; no penalty, bad word or min_tokens ban)."""
    p = request.params
    return (greedy_rows(p.temperature, p.top_p, p.top_k) and p.repetition_penalty == 1
            and p.frequency_penalty == 0 and p.presence_penalty == 0 and not request.bad_words
            and request.num_output_tokens + offset >= p.min_tokens)


_ARGMAX_BATCHES: dict[int, SamplingBatch] = {}


def _argmax_batch(n: int) -> SamplingBatch:
    """n rows that each take the argmax of untouched logits: all alike, so one read-only batch per n serves every
    such step (a drafting step's rows, rebuilt at every step otherwise, cost ~40 us with their caches cold)."""
    batch = _ARGMAX_BATCHES.get(n)
    if batch is None:
        zeros, ones, empty = np.zeros(n, np.float32), np.ones(n, np.float32), ((),) * n
        batch = SamplingBatch(zeros, ones, np.full(n, -1, np.int64), zeros, ones, zeros, zeros, empty, empty, empty,
                              np.zeros(n), greedy=np.ones(n, bool), plain=True, untouched=True)
        for array in (zeros, ones, batch.top_k, batch.uniforms, batch.greedy):
            array.flags.writeable = False
        _ARGMAX_BATCHES[n] = batch
    return batch


_NONE_I64 = np.zeros(0, dtype=np.int64)
_NONE_I64.flags.writeable = False
_NONE_F32 = np.zeros(0, dtype=np.float32)
_NONE_F32.flags.writeable = False


def _int64(values: list[int]) -> np.ndarray:
    # Most of a step's per-row lists are empty (no bias, no logprobs): one shared read-only array for those.
    return np.asarray(values, dtype=np.int64) if values else _NONE_I64


def add_multimodal(forward: ForwardBatch, requests: list[Request], counts: list[int]) -> None:
    """3-D positions, token types and vision rows of a step with a multimodal request (the family's
    step_inputs.chunk_inputs says what each request's chunk takes)."""
    positions, types = [], []
    for request, n in zip(requests, counts):
        mm = request.mm
        pos, kinds, rows = chunk_inputs(mm, request.prompt_token_ids, request.num_computed_tokens, n)
        positions.append(pos)
        types.append(kinds)
        if rows is not None:
            forward.vision.append(VisionSlice(request.request_id, mm.pixel_values, mm.grid_thw, mm.row_order, *rows))
    forward.positions = np.ascontiguousarray(np.concatenate(positions, axis=1))
    forward.token_types = np.concatenate(types)


def build_step(requests: list[Request], counts: list[int], block_manager: BlockManager) -> ScheduledStep:
    ids: list[int] = []
    positions: list[int] = []
    context_lens: list[int] = []
    drafting = False
    for request, n in zip(requests, counts):
        begin = request.num_computed_tokens
        drafts = request.draft_token_ids
        if drafts:  # its last token, then the drafts to verify
            drafting = True
            ids.extend(request.token_ids[begin:])
            ids.extend(drafts)
        else:
            ids.extend(request.token_ids[begin:begin + n])
        positions.extend(range(begin, begin + n))
        context_lens.append(begin + n)
    # Rows that finish their known tokens this step produce the next token (a drafting request one per draft
    # too); prompt rows of requests asking for prompt_logprobs get logits too.
    starts = list(itertools.accumulate(counts, initial=0))
    sampling = [i for i, (r, c) in enumerate(zip(requests, context_lens))
                if c == r.num_tokens + len(r.draft_token_ids)]
    samplers = [requests[i] for i in sampling]
    if drafting:
        rows = [requests[i] for i in sampling for _ in range(1 + len(requests[i].draft_token_ids))]
        offsets = [j for i in sampling for j in range(1 + len(requests[i].draft_token_ids))]
        logit_rows = [starts[i + 1] - 1 - len(requests[i].draft_token_ids) + j
                      for i in sampling for j in range(1 + len(requests[i].draft_token_ids))]
    else:
        rows, offsets, logit_rows = samplers, None, [starts[i + 1] - 1 for i in sampling]
    prompt_rows = [(r, p, starts[i] + p - r.num_computed_tokens)
                   for i, r in enumerate(requests) if r.wants_prompt_logprobs
                   for p in range(r.num_computed_tokens, min(context_lens[i], r.num_prompt_tokens - 1))]
    forward = ForwardBatch(
        _int64(ids), _int64(positions), np.asarray(counts, dtype=np.int64), np.asarray(context_lens, dtype=np.int64),
        block_manager.table_array([r.request_id for r in requests]),
        _int64(logit_rows + [row for _, _, row in prompt_rows]))
    if any(r.mm is not None for r in requests):
        add_multimodal(forward, requests, counts)
    bias = [(j, t, v) for j, r in enumerate(rows) for t, v in r.params.logit_bias.items()]
    # Rows that want their token's logprob: asked for logprobs, or ranked as best_of candidates.
    logprob_rows = [j for j, r in enumerate(rows) if r.params.logprobs is not None or r.params.ranks_candidates]
    model_input = SchedulerOutput(
        forward=forward,
        sampling=sampling_batch(rows, offsets),
        forced_token_ids=_int64([r.forced_tokens[0] if r.forced_tokens else -1 for r in rows]
                                if any(r.forced_tokens for r in samplers) else []),
        bias_rows=_int64([j for j, _, _ in bias]),
        bias_token_ids=_int64([t for _, t, _ in bias]),
        bias_values=np.asarray([v for _, _, v in bias], dtype=np.float32) if bias else _NONE_F32,
        logprob_rows=_int64(logprob_rows),
        logprob_k=_int64([rows[j].params.logprobs or 0 for j in logprob_rows]),
        prompt_logprob_k=_int64([r.params.prompt_logprobs for r, _, _ in prompt_rows]),
        prompt_logprob_targets=_int64([r.prompt_token_ids[p + 1] for r, p, _ in prompt_rows]))
    if any(rows[j].params.temp_scaled_logprobs or rows[j].params.top_p_normalized_logprobs for j in logprob_rows):
        model_input.logprob_temperature, model_input.logprob_top_p = sampling_policy.logprob_transforms(
            [rows[j].params for j in logprob_rows])
    add_mtp_rows(model_input, requests, sampling, starts)
    return ScheduledStep(list(requests), list(counts), samplers, [(r, p) for r, p, _ in prompt_rows], model_input,
                         list(rows))


def add_mtp_rows(model_input: SchedulerOutput, requests: list[Request], sampling: list[int], starts: list[int]) -> None:
    """The step's requests whose drafts the runner makes with the MTP layer: every query row's hidden state
    handed back, and what the runner needs to know which are final (step_types.MtpRows)."""
    mtp = [i for i, r in enumerate(requests) if r.drafter is not None and r.drafter.runs_in_step]
    if not mtp:
        return
    first_row, row = {}, 0
    for i in sampling:
        first_row[i] = row
        row += 1 + len(requests[i].draft_token_ids)
    forward = model_input.forward
    forward.hidden_rows = np.concatenate([np.arange(starts[i], starts[i + 1], dtype=np.int64) for i in mtp])
    model_input.mtp = MtpRows(
        batch_index=_int64(mtp), num_drafts=_int64([len(requests[i].draft_token_ids) for i in mtp]),
        first_sample=_int64([first_row.get(i, -1) for i in mtp]),
        next_token=_int64([-1 if i in first_row else requests[i].token_ids[int(forward.context_lens[i])] for i in mtp]),
        draft_limit=_int64([requests[i].drafter.limit for i in mtp]),
        logprobs_k=_int64([_draft_logprobs_k(requests[i].params.logprobs) for i in mtp]))


def _draft_logprobs_k(logprobs: int | None) -> int:
    """Top entries of a draft's logprobs: the request's logprobs, at most 20 (FastDeploy's cap; -1: the whole
    vocabulary for its own tokens, 20 for drafts); -1 when it asked for none."""
    return -1 if logprobs is None else 20 if logprobs == -1 else min(logprobs, 20)


def plain_decoder(request: Request) -> bool:
    """Whether the request's decode steps stay the same every time, bar the token, on the request's side: no
    media, no grammar, nothing banned now or later (bad words, min_tokens) and nothing forced. The step's
    side (no bias, logprobs or prompt rows: only the sampler reads the logits) is sampling.policy's
    `sampler_alone`, the rule for the compiled step's in-forward sampling too."""
    return (request.mm is None and request.grammar is None and not request.bad_words and not request.forced_tokens
            and not request.below_min_tokens and (request.drafter is None or not request.drafter.runs_in_step))


def _owned(array: np.ndarray) -> memoryview:
    """SteadyDecode's writable view of a kept step's array, which becomes read-only to everyone else."""
    # Element updates through a memoryview: a numpy operation's code is cold after a step's weight stream and
    # costs 10-30 us the first time in a step, where writing a few elements this way costs a microsecond.
    view = memoryview(array).cast("B").cast(array.dtype.char)
    array.flags.writeable = False
    return view


class SteadyDecode:
    """The last step when it was plain decoding (see the module's doc), to be moved on by `advance`."""

    __slots__ = ("step", "sampled_rows", "jumped", "_ids", "_positions", "_context_lens", "_tables", "_uniforms")

    def __init__(self) -> None:
        self.step: ScheduledStep | None = None
        self.sampled_rows: list[int] = []  # rows that draw a uniform (not greedy)
        self.jumped = False  # a drafting step of the kept step's requests ran since it was last used

    def keep(self, step: ScheduledStep) -> None:
        """Keep a freshly built step if it is plain decoding: one token per request, each sampling. A drafting step
        of the kept step's requests (each decoding, some with drafts) leaves the kept step for the steps after it."""
        kept = self.step
        if (kept is not None and len(step.requests) == len(kept.requests) and len(step.rows) > len(step.samplers)
                and all(a is b and n == 1 + len(a.draft_token_ids)
                        for a, b, n in zip(step.requests, kept.requests, step.num_new_tokens))):
            self.jumped = True
            return
        forward = step.model_input.forward
        plain = (0 < len(forward.token_ids) == len(step.requests) == len(step.samplers) and not step.prompt_rows
                 and forward.token_types is None and sampler_alone(step.model_input)
                 and all(map(plain_decoder, step.requests)))
        self.step, self.jumped = (step if plain else None), False
        if plain:
            sampling = step.model_input.sampling
            self.sampled_rows = np.flatnonzero(~sampling.greedy_mask()).tolist()
            self._ids, self._positions, self._context_lens, self._tables, self._uniforms = map(
                _owned, (forward.token_ids, forward.positions, forward.context_lens, forward.block_tables,
                        sampling.uniforms))

    def forget(self) -> None:
        """Drop the kept step (a request of it finished or was preempted: it must not be kept alive)."""
        self.step = None

    def advance(self, requests: list[Request], counts: list[int], block_manager: BlockManager) -> ScheduledStep | None:
        """The kept step moved on by one token, if this step schedules the same requests for one token each
        (after the kept step each has exactly one new token, which it samples from); None otherwise."""
        step = self.step
        if (step is None or len(requests) != len(step.requests) or any(n != 1 for n in counts)
                or any(a is not b for a, b in zip(requests, step.requests))
                or any(r.forced_tokens for r in requests)):
            return None
        forward = step.model_input.forward
        if self.jumped:  # the drafting steps since may have crossed blocks (and rejected drafts' were freed)
            forward.block_tables = block_manager.table_array([r.request_id for r in requests])
            self._tables, self.jumped = _owned(forward.block_tables), False
        size, width = block_manager.block_size, forward.block_tables.shape[1]
        for i, request in enumerate(requests):
            position = request.num_computed_tokens
            self._ids[i] = request.token_ids[position]
            self._positions[i] = position
            self._context_lens[i] = position + 1
            if position % size == 0:  # the token starts a block, which allocate gave it this step
                index = position // size
                if index >= width:
                    forward.block_tables = block_manager.table_array([r.request_id for r in requests])
                    self._tables, width = _owned(forward.block_tables), forward.block_tables.shape[1]
                else:
                    self._tables[i * width + index] = block_manager.block_table(request.request_id)[index]
        for i in self.sampled_rows:
            self._uniforms[i] = requests[i].uniform(0)
        step.model_input.sampling.output_token_ids = [r.output_token_ids for r in requests]
        return step
