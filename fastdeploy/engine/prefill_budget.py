"""The cap on a step's prompt tokens while requests decode, measured from the steps' own times.

With chunked prefill, a step's prompt tokens are capped while requests decode (PrefillBudget): they delay
every decoding stream's next token by the time they take, so with a fixed token budget a new prompt
stalls the running streams for as long as the budget allows (2048 tokens: seconds on a CPU). A step may take
about twice a decode step of the batch being formed (the decoding requests plus those with prompt tokens to
compute, at most max_num_seqs), its prompt tokens filling what its decode tokens leave, so a stream's gap is
at most twice the steady one it will have once that batch decodes. The yardstick is the batch being formed,
not the one decoding now: a few streams decode fast, so their step would let prompts in only slowly, the
batch would stay small and, under load, throughput and time to first token collapse. With nothing decoding
(an offline batch starting, a lone long prompt) a step takes the whole max_num_batched_tokens.

The cap is measured, not configured: the time between consecutive `schedule()` calls is one whole step (the
forward, the output processing, the next scheduling), filed under that step's token count. A least-squares
line through those times gives the cost of one more token (its slope); a step's time is read where that size
was measured (else from the line). Prompt tokens allowed = (twice the batch's decode step - this step's
decode tokens' time) / cost per token, and a step at most twice the largest one measured. Until the line is
known the cap takes the time of a step as proportional to its tokens (2 x batch - decoding tokens), which
allows less than the line would, as a step has a fixed part. A floor keeps prompts moving whatever the
estimate says.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

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
        self._started: float | None = None  # when the current schedule() began
        self._open: tuple[int, float] | None = None  # the step scheduled last: tokens, start
        self._timed: tuple[int, float] | None = None  # that step once applied, if the engine went straight on
        self._skip_first = True  # the first step pays one-time costs (first calls, page faults)

    # ---- measuring ----------------------------------------------------------------------------
    def step_begins(self) -> None:
        """At the start of schedule(): the previous step's interval ends here."""
        now = self.clock()
        if self._timed is not None:
            tokens, start = self._timed
            self.record(tokens, now - start)
        self._timed = self._open = None
        self._started = now

    def step_scheduled(self, num_tokens: int) -> None:
        """At the end of schedule(), with the step's token count (0: an empty step, not timed)."""
        self._open = (num_tokens, self._started) if num_tokens and self._started is not None else None

    def step_applied(self, more_work: bool) -> None:
        """After the step's output is applied. Only when requests remain does the engine start the next step
        at once; otherwise the interval to the next one includes idle time and is no step's duration."""
        self._timed = self._open if more_work else None
        self._open = None

    def record(self, num_tokens: int, seconds: float) -> None:
        """One step of num_tokens tokens took `seconds`."""
        if self._skip_first:
            self._skip_first = False
            return
        old = self.seconds.pop(num_tokens, None)
        self.seconds[num_tokens] = seconds if old is None else old + SMOOTHING * (seconds - old)
        if len(self.seconds) > MAX_SIZES:
            self.seconds.popitem(last=False)

    # ---- the cap ------------------------------------------------------------------------------
    def line(self) -> tuple[float, float] | None:
        """Least-squares (fixed seconds, seconds per token) through the remembered sizes' mean times, or None
        while they span too little to tell a slope from noise, or the slope is not positive."""
        if len(self.seconds) < 2 or max(self.seconds) < MIN_SPAN * min(self.seconds):
            return None
        n = len(self.seconds)
        mean_x = sum(self.seconds) / n
        mean_t = sum(self.seconds.values()) / n
        sxx = sum((x - mean_x) ** 2 for x in self.seconds)
        slope = sum((x - mean_x) * (t - mean_t) for x, t in self.seconds.items()) / sxx
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
