"""Turns the requests the scheduler picked for a step into the runner's SchedulerOutput: plain arrays
of the ragged batch and of each sampling row's parameters, drawn uniforms, bans, bias and forced
tokens. Everything a request's policy decides is decided here, on the engine side."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.request import Request
from fastdeploy.ops.sampling_reference import SamplingBatch, greedy_rows
from fastdeploy.worker.step_types import ForwardBatch, SchedulerOutput


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


def banned_tokens(request: Request) -> list[int]:
    """Ids the request must not produce next: EOS and stop ids below min_tokens, and the last token of
    every bad-word sequence whose other tokens end the output."""
    banned = []
    if request.below_min_tokens:
        banned.extend(request.eos_token_ids)
        banned.extend(request.params.stop_token_ids or ())
    if request.bad_words:
        output = request.output_token_ids
        for seq in request.bad_words:
            if len(seq) == 1 or (len(seq) - 1 <= len(output) and tuple(output[len(output) - len(seq) + 1:]) == seq[:-1]):
                banned.append(seq[-1])
    return banned


def sampling_batch(requests: list[Request]) -> SamplingBatch:
    """The sampling rows of `requests`; each sampled (non-greedy) row draws its uniform from the
    request's own generator, in row order, so a seeded request's tokens never depend on the batch."""

    def column(name: str, dtype: type) -> np.ndarray:
        return np.array([getattr(r.params, name) for r in requests], dtype=dtype)

    temperature, top_p, top_k = column("temperature", np.float32), column("top_p", np.float32), column("top_k", np.int64)
    uniforms = np.zeros(len(requests), dtype=np.float64)
    for i in np.flatnonzero(~greedy_rows(temperature, top_p, top_k)):
        uniforms[i] = requests[i].generator.random()
    return SamplingBatch(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=column("min_p", np.float32),
        repetition_penalty=column("repetition_penalty", np.float32),
        frequency_penalty=column("frequency_penalty", np.float32),
        presence_penalty=column("presence_penalty", np.float32),
        prompt_token_ids=[r.prompt_token_ids for r in requests], output_token_ids=[r.output_token_ids for r in requests],
        banned_token_ids=[banned_tokens(r) for r in requests], uniforms=uniforms)


def _int64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def build_step(requests: list[Request], counts: list[int], block_manager: BlockManager) -> ScheduledStep:
    ids: list[int] = []
    positions: list[int] = []
    context_lens: list[int] = []
    for request, n in zip(requests, counts):
        begin = request.num_computed_tokens
        ids.extend(request.token_ids[begin:begin + n])
        positions.extend(range(begin, begin + n))
        context_lens.append(begin + n)
    # Rows that finish their known tokens this step produce the next token; prompt rows of requests
    # asking for prompt_logprobs get logits too.
    starts = np.cumsum([0] + list(counts))
    sampling = [i for i, (r, c) in enumerate(zip(requests, context_lens)) if c == r.num_tokens]
    samplers = [requests[i] for i in sampling]
    prompt_rows = [(r, p, int(starts[i]) + p - r.num_computed_tokens)
                   for i, r in enumerate(requests) if r.wants_prompt_logprobs
                   for p in range(r.num_computed_tokens, min(context_lens[i], r.num_prompt_tokens - 1))]
    forward = ForwardBatch(
        _int64(ids), _int64(positions), list(counts), context_lens,
        [block_manager.block_table(r.request_id) for r in requests],
        _int64([int(starts[i + 1]) - 1 for i in sampling] + [row for _, _, row in prompt_rows]))
    bias = [(j, t, v) for j, r in enumerate(samplers) for t, v in r.params.logit_bias.items()]
    logprob_rows = [j for j, r in enumerate(samplers) if r.params.logprobs is not None]
    model_input = SchedulerOutput(
        forward=forward,
        sampling=sampling_batch(samplers),
        forced_token_ids=_int64([r.forced_tokens[0] if r.forced_tokens else -1 for r in samplers]),
        bias_rows=_int64([j for j, _, _ in bias]),
        bias_token_ids=_int64([t for _, t, _ in bias]),
        bias_values=np.asarray([v for _, _, v in bias], dtype=np.float32),
        logprob_rows=_int64(logprob_rows),
        logprob_k=_int64([samplers[j].params.logprobs for j in logprob_rows]),
        prompt_logprob_k=_int64([r.params.prompt_logprobs for r, _, _ in prompt_rows]),
        prompt_logprob_targets=_int64([r.prompt_token_ids[p + 1] for r, p, _ in prompt_rows]))
    return ScheduledStep(list(requests), list(counts), samplers, [(r, p) for r, p, _ in prompt_rows], model_input)
