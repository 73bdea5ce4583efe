"""The scheduler's side of speculative decoding (speculative.py makes the drafts): which drafts a step verifies.

Per draft: a drafted position is verified when its chance of being kept beats the break-even of the measured step
line (`draft_threshold`). Per step: a step with drafts costs more than its extra positions, as it is built anew
instead of moved on in place (step_builder.py's SteadyDecode), its drafts are looked up and its rows sampled apart;
with a few requests drafting in a large batch of a small model that fixed cost is far more than what they gain. So
a batch verifies lookup drafts while what a step with drafts gains (from its requests' lookups: Drafter.hit, .gain,
.reach), each token worth a plain step's time over the batch, outweighs what a step with as many drafts takes over
a plain one and the next step's settling, all measured (`DraftPacing.verifies`). Meanwhile the requests still look
up now and then and watch their drafts against the tokens that follow (Drafter.watch): that tells what verifying
them would have kept, at no cost to the steps. The MTP layer drafts inside the step; only the per-draft rule paces
it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.request import Request
from fastdeploy.speculative import Drafter

# Every this many steps a request whose drafts do not pay still drafts one token, to notice when they would; all
# requests on the same steps, so that the steps between stay plain decoding (moved on in place).
PROBE_EVERY = 8
# A draft is verified when its chance of being kept beats the step line's break-even by this share, for what the
# line does not see. Measured on the 0.3B shape at 64 streams, wint4: drafts kept 96 % of the time, above a
# break-even of ~0.94, still cost 4-11 %.
DRAFT_MARGIN = 0.1
# Steps between refits of the step lines the decisions read, while the batch stays (a fit is ~5 us).
REFIT_EVERY = 32


class StepTimes(Protocol):
    """The scheduler's measured step times (scheduler.py's PrefillBudget)."""

    decode_seconds: Mapping[int, float]  # mean seconds of steady decoding steps, by their tokens
    settling: float  # what a plain step right after one with drafts takes more

    def line(self, table: Mapping[int, float] | None = None) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) through `table`'s times, by default all steps'; None: not known."""


class DraftPacing:
    """A scheduler's drafting decisions (the module's doc), over its block manager and its step times."""

    def __init__(self, block_manager: BlockManager, budget: StepTimes) -> None:
        self.block_manager = block_manager
        self.budget = budget
        # (step, batch, draft_threshold, decoding steps' line) as last fitted.
        self._fitted: tuple[int, int, float, tuple[float, float] | None] | None = None

    def verifies(self, requests: Sequence[Request], step: int) -> bool:
        """Whether the lookup drafts of this step of the decoding `requests` are verified. Read from the measured
        times of steady decoding steps: a plain step of the batch (measured first, by not verifying) and the slope
        of their line, which prices the drafts (a size's own mean may rest on one cold step; without a line it is
        read, and with neither, the step verifies, to measure)."""
        batch, seconds = len(requests), self.budget.decode_seconds
        if not batch:
            return True
        plain = seconds.get(batch)
        if plain is None:
            return False
        gained = drafts = 0.0  # over the requests whose lookups hit
        none = 1.0  # the chance that none does
        for request in requests:
            drafter = request.drafter
            if drafter is not None and not drafter.runs_in_step:
                gained, drafts = gained + drafter.hit * drafter.gain, drafts + drafter.hit * drafter.reach
                none *= 1.0 - drafter.hit
        if none == 1.0:
            return True  # nothing would draft
        gained, drafts = gained / (1.0 - none), max(1, round(drafts / (1.0 - none)))  # in a step with drafts
        fit = self._fit(step, batch)[3]
        if fit is not None:
            cost = fit[1] * drafts
        elif batch + drafts in seconds:
            cost = seconds[batch + drafts] - plain
        else:
            return True
        return gained * plain / batch > cost + self.budget.settling

    def draft(self, request: Request, room: int, verify: bool, step: int, batch: int) -> int:
        """Give a decoding request its drafts for this step: at most `room`, as many as pay (an MTP request's were
        limited when drafted), never past its max_tokens after the token it samples anyway; how many. Lookup
        drafts not to `verify` are watched instead."""
        drafter = request.drafter
        if not drafter.runs_in_step and step % PROBE_EVERY and (
                drafter.hit < 1 / PROBE_EVERY or not verify and (drafter.watched or not drafter.matched)):
            # A lookup is a few microseconds, a tenth of a plain step's Python at one stream: one whose lookups seldom
            # find anything looks every PROBE_EVERY-th step, and so does one that watches (drafts not verified)
            # unless the drafts it watched last came true.
            return 0
        worth = drafter.worth if drafter.runs_in_step else self.worth(drafter, step, batch)
        # No draft after a forced token (the end of a cut thinking part), which the step emits instead of a sample.
        limit = 0 if request.forced_tokens else min(room, request.max_tokens - request.num_output_tokens - 1, worth)
        if not verify and not drafter.runs_in_step:
            if limit > 0 and not drafter.watched:
                drafter.watch(drafter.propose(request.token_ids, limit))
            return 0
        drafts = drafter.propose(request.token_ids, limit) if limit > 0 else []
        if drafts and request.grammar is not None:
            drafts = drafts[:request.grammar.valid_drafts(drafts)]  # only what the grammar allows is worth checking
        if drafts and self.block_manager.free_after(request, 1 + len(drafts)) < 0:
            drafts = []  # drafts never push a request out of the cache
        if limit > 0:
            drafter.looked_up(len(drafts))
        request.draft_token_ids = drafts
        return len(drafts)

    def lookahead(self, request: Request, num_new: int, hits: Sequence[int], step: int, batch: int) -> int:
        """Cache slots an MTP-drafting request needs past this step's tokens, and its draft limit: its layer's k
        drafts need k - 1 slots (worker/mtp_proposer.py); only when the step completes the request's tokens (it
        samples), the pool has them, and the drafts stay within its max_tokens (else fewer)."""
        drafter = request.drafter
        end = request.num_computed_tokens + len(hits) * self.block_manager.block_size + num_new
        if end < request.num_tokens + len(request.draft_token_ids):
            drafter.limit = drafter.worth = 0  # a prompt chunk: it only fills the MTP layer's cache
            return 0
        drafter.worth = self.worth(drafter, step, batch)
        drafter.limit = max(0, min(drafter.worth, drafter.steps,
                                   request.num_prompt_tokens + request.max_tokens - end + 1))
        if drafter.limit > 1 and self.block_manager.free_after(request, num_new + drafter.limit - 1, hits) < 0:
            drafter.limit = 1  # no slots to spare: one draft needs none
        return max(drafter.limit - 1, 0)

    def worth(self, drafter: Drafter, step: int, batch: int) -> int:
        """Drafts worth verifying in this step (Drafter.length; every PROBE_EVERY-th step probes)."""
        return drafter.length(self._fit(step, batch)[2], step % PROBE_EVERY == 0)

    def _fit(self, step: int, batch: int) -> tuple[int, int, float, tuple[float, float] | None]:
        fitted = self._fitted
        if fitted is None or fitted[1] != batch or step - fitted[0] >= REFIT_EVERY:
            budget = self.budget
            fitted = self._fitted = (step, batch, draft_threshold(budget.line(), batch),
                                     budget.line(budget.decode_seconds) or budget.line())
        return fitted


def draft_threshold(line: tuple[float, float] | None, batch: int) -> float:
    """How likely a draft must be kept to be worth its position in a step of `batch` requests. A step of n
    tokens takes about fixed + per_token x n seconds (`line`, the scheduler's measure); one more position costs
    per_token and gains its chance p of being kept, so it raises the batch's tokens per second when
    p > per_token x batch / (fixed + per_token x batch): near 0 at one stream (a step is the weights' streaming),
    near 1 when the batch is compute-bound. 0 (draft all) until the line is known. Raised by DRAFT_MARGIN."""
    if line is None:
        return 0.0
    fixed, per_token = max(line[0], 0.0), line[1]
    cost = max(batch, 1) * per_token
    return min(1.0, (1 + DRAFT_MARGIN) * cost / (fixed + cost))
