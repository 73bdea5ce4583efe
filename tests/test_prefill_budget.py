"""Chunked prefill's budget while requests decode (PrefillBudget in engine/scheduler.py), with a fake
clock: every step "takes" FIXED + PER_TOKEN x its tokens, so the caps below are worked out by hand from that cost."""
import numpy as np
import pytest

from conftest import TINY_HF
from fastdeploy.config import EngineConfig
from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.scheduler import MIN_PREFILL_TOKENS, PrefillBudget, Scheduler
from fastdeploy.engine.request import Request, RequestMetrics
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.cli_args import engine_config, make_parser
from fastdeploy.step_types import ModelRunnerOutput

PER_TOKEN = 1 / 64  # seconds: binary fractions, so the fitted line is exact
FIXED = 0.5 + 0.5 / 64  # = 32.5 tokens' worth: a step of n tokens is worth n + 32.5 tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cost(tokens: int) -> float:
    return FIXED + PER_TOKEN * tokens


def request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(3, 3 + prompt_len)),
                   params=SamplingParams().with_model_defaults({}), max_tokens=max_tokens, eos_token_ids=frozenset(),
                   generator=np.random.default_rng(0), metrics=RequestMetrics(arrival_time=0.0))


def scheduler(clock: Clock, budget: int = 256, max_num_seqs: int = 8, chunked: bool = True) -> Scheduler:
    return Scheduler(BlockManager(2000, 4, enable_prefix_caching=False), max_num_seqs, budget, chunked, clock=clock)


def step(sched: Scheduler, clock: Clock, cost_of=cost) -> dict[str, int]:
    """One engine step: schedule, the forward taking cost_of(tokens) on the clock, the output applied. The
    tokens each request got, by id."""
    scheduled = sched.schedule()
    clock.now += cost_of(sum(scheduled.num_new_tokens))
    sched.update_from_output(scheduled, ModelRunnerOutput([7] * len(scheduled.samplers)))
    return {r.request_id: n for r, n in zip(scheduled.requests, scheduled.num_new_tokens)}


# ---- PrefillBudget alone ----------------------------------------------------------------------------------


def budget_with(sizes: list[int], max_tokens: int = 256) -> PrefillBudget:
    budget = PrefillBudget(max_tokens)
    budget.record(1, 99.0)  # the first step (warm-up costs) is not taken
    for x in sizes:
        budget.record(x, cost(x))
    return budget


def test_a_step_keeps_within_twice_a_decode_step_of_the_batch_being_formed():
    budget = budget_with([4, 40, 12, 300])
    assert budget.line() == pytest.approx((FIXED, PER_TOKEN))
    # Twice a decode step of the batch being formed, less this step's decode tokens, in tokens' worth:
    assert budget.prefill_limit(4, batch=4) == 36  # 2 x 36.5 - 36.5, rounded down
    assert budget.prefill_limit(4, batch=8) == 44  # 4 decoding and 4 prompts to compute: 2 x 40.5 - 36.5
    assert budget.prefill_limit(1, batch=64) == 159  # 2 x 96.5 - 33.5
    assert budget.prefill_limit(200, batch=200) == 56  # the rest of the 256-token budget
    assert budget.prefill_limit(0, batch=5) == 256  # nothing decodes: the whole budget


def test_a_measured_step_time_counts_over_the_line():
    budget = budget_with([4, 400])
    budget.record(8, 2 * cost(8))  # steps of 8 tokens measured slower than the line says
    fixed, per_token = budget.line()
    assert budget.prefill_limit(4, batch=8) == int((2 * 2 * cost(8) - cost(4)) / per_token)


def test_the_line_is_followed_at_most_to_twice_the_largest_step_measured():
    budget = budget_with([10, 20])
    assert budget.line() == pytest.approx((FIXED, PER_TOKEN))
    assert budget.prefill_limit(10, batch=10) == 30  # 2 x 20 - 10 (the line says 42)
    assert budget.prefill_limit(1, batch=64) == 39  # 2 x 20 - 1 (the line says 159)
    budget.record(100, cost(100))
    assert budget.prefill_limit(10, batch=10) == 42


@pytest.mark.parametrize("sizes", [[], [4], [4, 6, 7]])
def test_until_a_slope_is_known_a_step_is_taken_as_proportional_to_its_tokens(sizes):
    budget = budget_with(sizes)
    assert budget.line() is None  # no size, one size, or sizes too close to tell a slope from noise
    assert budget.prefill_limit(1, batch=2) == MIN_PREFILL_TOKENS  # 2 x 2 - 1, raised to the floor
    assert budget.prefill_limit(1, batch=40) == 79
    assert budget.prefill_limit(250, batch=250) == 6  # within the budget


def test_a_slope_that_is_not_positive_is_not_trusted():
    budget = PrefillBudget(256)
    budget.record(1, 0.0)
    budget.record(4, 1.0)
    budget.record(40, 0.5)  # bigger steps faster: noise
    assert budget.line() is None and budget.prefill_limit(20, batch=30) == 40


def test_only_back_to_back_steps_are_timed():
    clock = Clock()
    budget = PrefillBudget(256, clock)
    for tokens, more_work, seconds in [(10, True, 1.0),  # the first: skipped
                                       (20, True, 2.0),  # recorded
                                       (30, False, 3.0),  # the engine then idles 50 s: not a step's time
                                       (40, True, 4.0)]:
        clock.now += 50.0 if tokens == 40 else 0.0
        budget.step_begins()
        budget.step_scheduled(tokens)
        clock.now += seconds
        budget.step_applied(more_work)
    budget.step_begins()
    assert dict(budget.seconds) == {20: 2.0, 40: 4.0}


def test_a_sizes_time_is_a_running_mean_and_old_sizes_are_forgotten():
    budget = budget_with([4])
    budget.record(4, cost(4) + 1.0)
    assert budget.seconds[4] == pytest.approx(cost(4) + 0.25)
    for x in range(100, 200):
        budget.record(x, cost(x))
    assert 4 not in budget.seconds and len(budget.seconds) == 32


# ---- the Scheduler --------------------------------------------------------------------------------------


def test_prompt_tokens_are_capped_only_while_requests_decode():
    clock = Clock()
    sched = scheduler(clock)
    for i in range(4):
        sched.add(request(f"d{i}", 8, max_tokens=8))
    assert step(sched, clock) == {"d0": 8, "d1": 8, "d2": 8, "d3": 8}  # nothing decodes: the whole budget
    step(sched, clock)
    step(sched, clock)  # decode steps of 4 tokens: one size measured, no slope yet
    sched.add(request("long", 300, max_tokens=4))
    chunks = []
    while sched.requests["long"].num_computed_tokens < 300:
        got = step(sched, clock)
        assert sum(n for n in got.values() if n == 1) in (0, 4)  # the decoders are never left out
        chunks.append((got["long"], sum(1 for r in ("d0", "d1", "d2", "d3") if r in got)))
    # The batch being formed is 5 (4 decoding, 1 prompt). 16: no slope yet, so 2 x 5 - 4, raised to the floor.
    # The 20-token step gives the line its second size; it says 38 = int(2 x cost(5) / PER_TOKEN - 36.5), but a
    # step may be at most twice the largest measured (2 x 20 - 4 = 36); then 38, until the decoders finish (8
    # tokens each); then the rest of the prompt in one step.
    assert chunks == [(16, 4), (36, 4), (38, 4), (38, 4), (38, 4), (134, 0)]
    # Each capped step took at most two decode steps of the batch being formed.
    assert cost(4 + 38) <= 2 * cost(5)


def test_a_lone_long_prompt_takes_whole_budgets():
    clock = Clock()
    sched = scheduler(clock, budget=64)
    sched.add(request("long", 1000, max_tokens=2))
    chunks = [step(sched, clock)["long"] for _ in range(-(-1000 // 64))]
    assert chunks == [64] * 15 + [40]
    assert sched.requests["long"].num_computed_tokens == 1000


def test_prompts_always_progress_however_costly_tokens_measure():
    clock = Clock()
    sched = scheduler(clock)
    per_token_only = lambda tokens: 10.0 * tokens  # no fixed part: a decode token is worth one prompt token
    sched.prefill_budget.record(1, 0.0)  # stands for the warm-up step, which is not taken
    sched.prefill_budget.record(40, per_token_only(40))
    sched.add(request("decoder", 4, max_tokens=100))
    step(sched, clock, per_token_only)
    sched.add(request("a", 50, max_tokens=2))
    sched.add(request("b", 30, max_tokens=2))
    got = [step(sched, clock, per_token_only) for _ in range(5)]
    assert sched.prefill_budget.line() == pytest.approx((0.0, 10.0))  # it says 2 x 3 - 1 = 5 prompt tokens
    # The floor: a's 50 as 16 + 16 + 16 + 2, b's 30 as 14 beside a's last 2, then 16 (a decodes then too).
    assert [(g.get("a", 0), g.get("b", 0)) for g in got] == [(16, 0), (16, 0), (16, 0), (2, 14), (1, 16)]


def test_many_waiting_prompts_share_the_cap_in_arrival_order():
    clock = Clock()
    sched = scheduler(clock)
    sched.prefill_budget.record(1, 0.0)  # stands for the warm-up step, which is not taken
    sched.prefill_budget.record(40, cost(40))
    sched.add(request("d", 4, max_tokens=50))
    step(sched, clock)  # its 4 tokens: the line's second size
    for name in "abc":
        sched.add(request(name, 20, max_tokens=2))
    got = step(sched, clock)
    # A batch of 4 (d and three prompts), its step measured: 39 = int(2 x 36.5 - 33.5) prompt tokens.
    assert got == {"d": 1, "a": 20, "b": 19}


def test_the_batch_being_formed_is_the_decoding_and_prompt_requests_within_the_seats():
    clock = Clock()
    sched = scheduler(clock, max_num_seqs=4)
    asked = []
    limit = sched.prefill_budget.prefill_limit

    def spy(decoding: int, batch: int) -> int:
        asked.append((decoding, batch))
        return limit(decoding, batch)

    sched.prefill_budget.prefill_limit = spy
    sched.add(request("d", 4, max_tokens=50))
    step(sched, clock)  # d's prompt, nothing decoding
    step(sched, clock)  # d decodes, nothing waits: not asked
    sched.add(request("p", 100, max_tokens=2))
    step(sched, clock)  # d decodes, p's first chunk
    for i in range(10):
        sched.add(request(f"w{i}", 20, max_tokens=2))
    step(sched, clock)  # d decodes, p part-way, 10 waiting for 2 free seats
    assert asked == [(0, 1), (1, 2), (1, 4)]


def test_without_chunked_prefill_prompts_are_never_cut():
    clock = Clock()
    sched = scheduler(clock, budget=256, chunked=False)
    sched.add(request("d", 4, max_tokens=50))
    step(sched, clock)
    step(sched, clock)
    sched.add(request("p", 200, max_tokens=2))
    assert step(sched, clock) == {"d": 1, "p": 200}


# ---- the default ----------------------------------------------------------------------------------------


def test_chunked_prefill_is_on_by_default_with_fastdeploys_budget():
    config = EngineConfig(model=str(TINY_HF))
    assert config.enable_chunked_prefill is True and config.max_num_batched_tokens == 2048
    assert EngineConfig(model=str(TINY_HF), max_num_seqs=256).max_num_batched_tokens == 2048
    off = EngineConfig(model=str(TINY_HF), enable_chunked_prefill=False, max_model_len=512)
    assert off.max_num_batched_tokens == 512


def test_the_servers_flag_follows_the_default_and_can_turn_it_off():
    base = ["--model", str(TINY_HF), "--max-model-len", "64"]
    assert engine_config(make_parser().parse_args(base)).enable_chunked_prefill is True
    off = engine_config(make_parser().parse_args([*base, "--no-enable-chunked-prefill"]))
    assert off.enable_chunked_prefill is False and off.max_num_batched_tokens == 64
