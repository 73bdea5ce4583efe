"""Continuous batching with a token budget per step (vLLM V1's idea).

There are no prefill and decode phases: each step every scheduled request gets enough new
tokens for its computed tokens to catch up with its known tokens, within the step's budget. A
prompt chunk and a single decode token are the same thing. Running requests go first, then
waiting ones in arrival order. When blocks run out, the newest running request is preempted:
its blocks are freed and it is recomputed later (its generated tokens are kept). While others run, a
new prompt is admitted only if its whole prompt leaves (1 - kv_cache_ratio) of the blocks free, as
FastDeploy's kv_cache_ratio: that reserve is for the running requests' outputs to grow into, so a burst of
long prompts does not push them into preemption.

With chunked prefill, a step's prompt tokens are capped while requests decode (PrefillBudget, below): they delay
every decoding stream's next token by the time they take, so with a fixed token budget a new prompt
stalls the running streams for as long as the budget allows (2048 tokens: seconds on a CPU). A step may take
about twice a decode step of the batch being formed (the decoding requests plus those with prompt tokens to
compute, at most max_num_seqs), its prompt tokens filling what its decode tokens leave, so a stream's gap is
at most twice the steady one it will have once that batch decodes. The yardstick is the batch being formed,
not the one decoding now: a few streams decode fast, so their step would let prompts in only slowly, the
batch would stay small and, under load, throughput and time to first token collapse. With nothing decoding
(an offline batch starting, a lone long prompt) a step takes the whole max_num_batched_tokens.

The cap is measured, not configured: the time between consecutive `schedule()` calls is one whole step, filed
under its token count (decoding steps apart too: what a draft costs, drafting.py's DraftPacing). A least-squares
line through those times gives the cost of one more token. Prompt tokens allowed = (twice the batch's decode step
- this step's decode tokens' time) / cost per token, a step at most twice the largest one measured; until the line
is known, 2 x batch - decoding tokens (less, as a step has a fixed part). A floor keeps prompts moving.

The scheduler owns the requests' progress. `schedule()` turns the chosen requests into the runner's SchedulerOutput
(step_builder.py, which also moves a plain decoding batch's last step on); `update_from_output()` applies the
runner's ModelRunnerOutput (computed tokens, cached blocks, new tokens, stop checks, finishing, freeing) in one place.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.request import Request, RequestStatus
from fastdeploy.engine.step_builder import ScheduledStep, SteadyDecode, build_step
from fastdeploy.engine.drafting import DraftPacing
from fastdeploy.step_types import ModelRunnerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, kv_cache_ratio: float = 1.0,
                 clock: Callable[[], float] = time.perf_counter, speculative: bool = False):
        self.block_manager = block_manager
        self.decode_reserve = int(len(block_manager.blocks) * (1.0 - kv_cache_ratio))  # blocks, see the module doc
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.prefill_budget = PrefillBudget(max_num_batched_tokens, clock)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # the unfinished ones, by id
        self.num_preemptions = 0
        self.num_steps = 0  # scheduled so far
        # Which drafts a step verifies, under speculative decoding (a request's drafter then drafts).
        self.pacing = DraftPacing(block_manager, self.prefill_budget) if speculative else None
        self._steady = SteadyDecode()
        self._drafted = False  # the last step verified drafts (timed for the pacing)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        self.prefill_budget.step_begins()
        budget = self.max_num_batched_tokens
        prefill = self._prefill_limit()
        self.num_steps += 1
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted = prompting = False  # prompting: a prompt chunk is in the step
        verify = self.pacing is None or self.pacing.verifies(self.running, self.num_steps)

        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            prompt = num_new > 1  # a chunk of its prompt (or of its recomputation), not a decode token
            if prompt:
                num_new = min(num_new, prefill)
                if num_new == 0:
                    continue  # part-way through its prompt: waits for a step with prompt tokens to spare
            elif request.drafter is not None and budget > 1:
                num_new += self.pacing.draft(request, budget - 1, verify, self.num_steps, len(self.running))
            lookahead = self._lookahead(request, num_new)
            while not self.block_manager.allocate(request, num_new + lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            scheduled.append(request)
            counts.append(num_new)
            budget -= num_new
            if prompt:
                prefill -= num_new
                prompting = True

        # Admitting new work right after a preemption would only thrash the cache.
        while (self.waiting and not preempted and budget > 0 and prefill > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            leader = request.prefix_leader
            if leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens:
                break  # a sibling sample waits one step to reuse its leader's cached prompt blocks
            hits = self.block_manager.match_prefix(request)
            num_new = request.num_tokens - request.num_computed_tokens - len(hits) * self.block_manager.block_size
            if self.running and self.block_manager.free_after(request, num_new, hits) < self.decode_reserve:
                break  # the rest of the pool is the running requests' to grow into
            if num_new > min(budget, prefill):
                if not self.enable_chunked_prefill:
                    break
                num_new = min(budget, prefill)
            lookahead = self._lookahead(request, num_new, hits)
            if not self.block_manager.allocate(request, num_new + lookahead, hits):
                break
            if hits:
                request.num_cached_tokens = len(hits) * self.block_manager.block_size
                request.num_computed_tokens += request.num_cached_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.metrics.inference_start_time is None:
                m = request.metrics
                m.inference_start_time = time.time()
                m.time_in_queue = m.inference_start_time - (m.arrival_time + (m.preprocess_cost_time or 0.0))
            self.running.append(request)
            scheduled.append(request)
            counts.append(num_new)
            budget -= num_new
            prefill -= num_new
            prompting = prompting or num_new > 1
        step = self._steady.advance(scheduled, counts, self.block_manager)
        moved = step is not None
        if step is None:
            step = build_step(scheduled, counts, self.block_manager)
            self._steady.keep(step)
        timing = None
        if self.pacing is not None:
            # Decoding steps are timed apart when moved on or drafting: what plain decoding or drafting costs a steady
            # batch (a plain step built anew costs more), and a plain one right after drafts apart again.
            after_drafts, self._drafted = self._drafted, not moved and len(step.rows) > len(step.samplers)
            timing = (("settling" if after_drafts else "steady") if moved else
                      "steady" if self._drafted and not prompting else None)
        self.prefill_budget.step_scheduled(sum(counts), timing)
        return step

    def _prefill_limit(self) -> int:
        """Prompt tokens this step may take: the whole budget without chunked prefill (a prompt goes whole or
        waits) or with nothing decoding, else prefill_budget's cap."""
        if not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        decoding = 0
        prompts = len(self.waiting)
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                decoding += 1
            else:
                prompts += 1
        if not prompts:
            return self.max_num_batched_tokens
        return self.prefill_budget.prefill_limit(decoding, min(decoding + prompts, self.max_num_seqs))

    def _lookahead(self, request: Request, num_new: int, hits: list[int] | tuple = ()) -> int:
        if request.drafter is None or not request.drafter.runs_in_step:
            return 0  # only the MTP layer drafts past the step's tokens
        return self.pacing.lookahead(request, num_new, hits, self.num_steps, len(self.running))

    def update_from_output(self, step: ScheduledStep, output: ModelRunnerOutput) -> list[Request]:
        """Apply a step's result; return the requests that got a new token (some now finished). A drafting
        request emits its sampled tokens up to the first that differs from its draft (speculative.py); only
        the K/V of what it emitted counts as computed. `step.emitted` gets each sampler's tokens."""
        for request, n in zip(step.requests, step.num_new_tokens):
            if not request.draft_token_ids:
                request.num_computed_tokens += n
                self.block_manager.cache_full_blocks(request)
        now = time.time()
        tokens = output.sampled_token_ids
        row = 0
        step.emitted, step.draft_logprobs = [], []
        for request in step.samplers:
            drafts = request.draft_token_ids
            emitted = []
            for j in range(1 + len(drafts)):
                token = tokens[row + j]
                emitted.append(token)
                request.token_ids.append(token)
                if request.forced_tokens:
                    request.forced_tokens.pop(0)  # the runner emitted it instead of a sample
                self._check_stop(request, token)
                if request.is_finished or j == len(drafts) or token != drafts[j]:
                    break
            row += 1 + len(drafts)
            request.use_uniforms(len(emitted))
            if request.drafter is not None and request.drafter.watched:
                request.drafter.witness(emitted)
            kept_logprobs = []
            if drafts:
                accepted = request.drafter.settle(emitted, drafts)
                kept_logprobs = request.drafter.accepted_logprobs(accepted)
                request.metrics.num_draft_tokens += len(drafts)
                request.metrics.num_accepted_tokens += accepted
                request.draft_token_ids = []
                if not request.is_finished:  # the last token and the accepted drafts went through the model
                    request.num_computed_tokens += len(emitted)
                    self.block_manager.cache_full_blocks(request)
            if (drafts or request.drafter is not None and request.drafter.runs_in_step) and not request.is_finished:
                self.block_manager.trim(request)  # rejected drafts' blocks, MTP slots past the tokens
            m = request.metrics  # FastDeploy's meanings: durations up to this (the latest) output token
            if m.first_token_time is None:
                m.first_token_time = now - m.inference_start_time
            m.model_forward_time = now - m.inference_start_time
            m.model_execute_time = now - m.arrival_time
            step.emitted.append(emitted)
            step.draft_logprobs.append(kept_logprobs)
        mtp = step.model_input.mtp
        if mtp is not None:
            for i, drafts, logprobs in zip(mtp.batch_index.tolist(), output.draft_token_ids, output.draft_logprobs):
                request = step.requests[i]
                request.drafter.offer(drafts, request.num_tokens, logprobs)
        self.prefill_budget.step_applied(self.has_unfinished())
        return step.samplers

    def take_back(self, request: Request, count: int) -> None:
        """Drop the last `count` tokens a step emitted: its drafts took the request past a stop string or past
        the end of its thinking budget (reasoning_max_tokens), where the output processor cut it."""
        if count:
            del request.token_ids[-count:]
            if request.drafter is not None:
                request.drafter.rewind(request.num_tokens)
            request.unuse_uniforms(count)
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)

    def _check_stop(self, request: Request, token: int) -> None:
        if not request.below_min_tokens and (
                token in request.eos_token_ids or token in (request.params.stop_token_ids or ())):
            self.finish_request(request, "stop", token)
        elif request.num_output_tokens >= request.max_tokens:
            self.finish_request(request, "length")

    def finish_request(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish the request and free its blocks. Finishing one already finished only changes its reason
        (a stop string found in the final text)."""
        request.finish(reason, stop_reason)
        self._steady.forget()
        if self.requests.pop(request.request_id, None) is None:
            return
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.release(request.request_id)

    def _preempt(self, request: Request) -> None:
        self._steady.forget()
        request.draft_token_ids = []
        self.running.remove(request)
        self.block_manager.release(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        logger.debug("preempted request %s (recomputed later)", request.request_id)


# Fewest prompt tokens a step with waiting prompt tokens takes (unless the budget is smaller): prompts always
# progress, a 2048-token prompt in at most 128 steps, even if the measured cost is off (a noisy machine).
MIN_PREFILL_TOKENS = 16
# Step sizes remembered (the least recently measured are forgotten): enough for decode batches of several
# sizes and the mixed steps above them, few enough to refit in a few microseconds.
MAX_SIZES = 32
# Weight of a new measurement in its size's running mean: a noisy step moves it by a quarter, a lasting
# change (longer contexts, another load on the machine) shows within a few steps.
SMOOTHING = 0.25
# The line is trusted once its sizes span this factor; a slope from nearly equal sizes is noise.
MIN_SPAN = 2.0


class PrefillBudget:
    """Step times by step size, and the prompt tokens a step may take given how many requests decode in it and
    the batch being formed."""

    def __init__(self, max_num_batched_tokens: int, clock: Callable[[], float] = time.perf_counter):
        self.max_tokens = max_num_batched_tokens
        self.clock = clock
        self.seconds: OrderedDict[int, float] = OrderedDict()  # step tokens -> mean step time, oldest first
        # For DraftPacing: the same for steady decoding steps alone (moved on in place, or with drafts), and what a
        # plain one right after drafts takes more (the compiled step re-reads its batch: ~9 % of the demo's step).
        self.decode_seconds: OrderedDict[int, float] = OrderedDict()
        self.settling = 0.0
        self._started: float | None = None  # when the current schedule() began
        self._open: tuple[int, float, str | None] | None = None  # the step scheduled last: tokens, start, timing
        self._timed: tuple[int, float, str | None] | None = None  # that step once applied, if the engine went on
        self._skip_first = True  # the first step pays one-time costs (first calls, page faults)

    # ---- measuring ----------------------------------------------------------------------------
    def step_begins(self) -> None:
        """At the start of schedule(): the previous step's interval ends here."""
        now = self.clock()
        if self._timed is not None:
            tokens, start, timing = self._timed
            self.record(tokens, now - start, timing)
        self._timed = self._open = None
        self._started = now

    def step_scheduled(self, num_tokens: int, timing: str | None = None) -> None:
        """At the end of schedule(), with the step's token count (0: an empty step, not timed) and, for a decoding
        step, "steady" (moved on in place, or with drafts) or "settling" (moved on right after drafts)."""
        self._open = (num_tokens, self._started, timing) if num_tokens and self._started is not None else None

    def step_applied(self, more_work: bool) -> None:
        """After the step's output is applied. Only when requests remain does the engine start the next step
        at once; otherwise the interval to the next one includes idle time and is no step's duration."""
        self._timed = self._open if more_work else None
        self._open = None

    def record(self, num_tokens: int, seconds: float, timing: str | None = None) -> None:
        """One step of num_tokens tokens took `seconds`."""
        if self._skip_first:
            self._skip_first = False
            return
        if timing == "settling" and num_tokens in self.decode_seconds:
            self.settling += SMOOTHING * (seconds - self.decode_seconds[num_tokens] - self.settling)
        for table in (self.seconds, self.decode_seconds) if timing == "steady" else (self.seconds,):
            old = table.pop(num_tokens, None)
            # A decoding step slower than the mean moves it less: one slow step (this machine's noise) must not
            # make a plain step look dear to DraftPacing for the many steps until its size is measured again.
            weight = SMOOTHING / 4 if table is self.decode_seconds and old is not None and seconds > old else SMOOTHING
            table[num_tokens] = seconds if old is None else old + weight * (seconds - old)
            if len(table) > MAX_SIZES:
                table.popitem(last=False)

    # ---- the cap ------------------------------------------------------------------------------
    def line(self, table: OrderedDict[int, float] | None = None) -> tuple[float, float] | None:
        """Least-squares (fixed seconds, seconds per token) through the remembered sizes' mean times (of `table`,
        by default all steps'), or None while they span too little to tell a slope from noise, or the slope is
        not positive."""
        table = self.seconds if table is None else table
        if len(table) < 2 or max(table) < MIN_SPAN * min(table):
            return None
        n = len(table)
        mean_x = sum(table) / n
        mean_t = sum(table.values()) / n
        sxx = sum((x - mean_x) ** 2 for x in table)
        slope = sum((x - mean_x) * (t - mean_t) for x, t in table.items()) / sxx
        if slope <= 0.0:
            return None
        return mean_t - slope * mean_x, slope

    def prefill_limit(self, num_decoding: int, batch: int) -> int:
        """Prompt tokens a step may take beside num_decoding decode tokens (the whole budget when none), batch
        being the number of requests the step's batch is heading to (decoding and with prompt tokens to compute,
        at most max_num_seqs)."""
        room = self.max_tokens - num_decoding
        if num_decoding == 0:
            return room
        line = self.line()
        if line is None:
            allowed = 2 * batch - num_decoding  # see the module doc
        else:
            fixed, per_token = line

            def step_seconds(tokens: int) -> float:
                return self.seconds.get(tokens, fixed + per_token * tokens)
            allowed = int(max(2 * step_seconds(batch) - step_seconds(num_decoding), 0.0) / per_token)
            # The line is trusted up to twice the largest step it has seen: a slope from noisy small steps may be
            # far too flat, and one step there measures it again.
            allowed = min(allowed, 2 * max(self.seconds) - num_decoding)
        return min(room, max(allowed, MIN_PREFILL_TOKENS))
