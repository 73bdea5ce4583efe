"""The next step of a plain decoding batch, made by moving the last one on by a token.

While a batch only decodes, every request one new token sampled with nothing but its sampling policy (no
bans, bias, logprobs, forced tokens, grammar or media: `plain_decoder` for the requests,
sampling.stage.sampler_alone for the step), a step differs from the last by one token per request: the ids,
positions and context lengths move on, a block table gains a block now and then and the sampled rows draw
new uniforms. So the scheduler keeps such a step and, when it schedules the same requests the same way
again, updates that step's arrays in place instead of building them anew (vLLM's persistent batch, in
small). At one stream building a step was ~0.1 ms, most of the scheduler's time per token.

The kept step is handed to the runner again, so nothing may hold a step's arrays past the step: the runner
reads them during `execute` and the tensor-parallel workers get copies.
"""
from __future__ import annotations

import numpy as np

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.request import Request
from fastdeploy.engine.step_builder import ScheduledStep
from fastdeploy.sampling.stage import sampler_alone


def plain_decoder(request: Request) -> bool:
    """Whether the request's decode steps stay the same every time, bar the token, on the request's side: no
    media, no grammar, nothing banned now or later (bad words, min_tokens) and nothing forced. The step's
    side (no bias, logprobs or prompt rows: only the sampler reads the logits) is sampling.stage's
    `sampler_alone`, the rule the compiled step's in-forward sampling starts from too."""
    return (request.mm is None and request.grammar is None and not request.bad_words and not request.forced_tokens
            and not request.below_min_tokens)


def _flat(array: np.ndarray) -> memoryview:
    # Element updates through a memoryview: a numpy operation's code is cold after a step's weight stream and
    # costs 10-30 us the first time in a step, where writing a few elements this way costs a microsecond.
    return memoryview(array).cast("B").cast(array.dtype.char)


class SteadyDecode:
    """The last step when it was plain decoding (see the module's doc), to be moved on by `advance`."""

    __slots__ = ("step", "sampled_rows", "_ids", "_positions", "_context_lens", "_tables", "_uniforms")

    def __init__(self) -> None:
        self.step: ScheduledStep | None = None
        self.sampled_rows: list[int] = []  # rows that draw a uniform (not greedy)

    def keep(self, step: ScheduledStep) -> None:
        """Keep a freshly built step if it is plain decoding: one token per request, each sampling."""
        forward = step.model_input.forward
        plain = (0 < len(forward.token_ids) == len(step.requests) == len(step.samplers) and not step.prompt_rows
                 and forward.token_types is None and sampler_alone(step.model_input)
                 and all(map(plain_decoder, step.requests)))
        self.step = step if plain else None
        if plain:
            sampling = step.model_input.sampling
            self.sampled_rows = np.flatnonzero(~sampling.greedy_mask()).tolist()
            self._ids, self._positions, self._context_lens, self._tables, self._uniforms = map(
                _flat, (forward.token_ids, forward.positions, forward.context_lens, forward.block_tables,
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
                    self._tables, width = _flat(forward.block_tables), forward.block_tables.shape[1]
                else:
                    self._tables[i * width + index] = block_manager.block_table(request.request_id)[index]
        for i in self.sampled_rows:
            self._uniforms[i] = requests[i].generator.random()
        step.model_input.sampling.output_token_ids = [r.output_token_ids for r in requests]
        return step
