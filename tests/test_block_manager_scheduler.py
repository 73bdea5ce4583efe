"""BlockManager and Scheduler on their own, with hand-checked expectations."""
import dataclasses

import numpy as np
import pytest

from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.request import Request, RequestMetrics, RequestStatus
from fastdeploy.engine.sampling_params import SamplingParams
from fastdeploy.engine.scheduler import Scheduler
from fastdeploy.engine.step_builder import sampling_batch
from fastdeploy.step_types import ModelRunnerOutput


def make_request(tokens, rid="r", cache_salt=None):
    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   params=SamplingParams().with_model_defaults({}), max_tokens=8, eos_token_ids=frozenset(),
                   generator=np.random.default_rng(0), metrics=RequestMetrics(arrival_time=0.0), cache_salt=cache_salt)


def run_prefill(bm, request):
    """What the scheduler and a step do for a whole prompt: adopt the prefix hits, compute the rest."""
    hits = bm.match_prefix(request)
    num_new = request.num_tokens - len(hits) * bm.block_size
    assert bm.allocate(request, num_new, hits)
    request.num_computed_tokens += len(hits) * bm.block_size + num_new
    bm.cache_full_blocks(request)
    return hits


def test_allocation_covers_tokens_and_release_returns_blocks():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    r = make_request(range(9))
    assert bm.allocate(r, 9)
    assert len(bm.block_table("r")) == 3 and bm.num_free_blocks == 7
    r.num_computed_tokens = 9
    assert bm.allocate(r, 3)  # 12 tokens still fit in 3 blocks
    assert len(bm.block_table("r")) == 3
    assert bm.allocate(r, 4)  # 13 tokens need a 4th
    assert len(bm.block_table("r")) == 4
    bm.release("r")
    assert bm.num_free_blocks == 10 and bm.block_table("r") == []


def test_allocation_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    r = make_request(range(12))
    assert not bm.allocate(r, 12)
    assert bm.block_table("r") == [] and bm.num_free_blocks == 2


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request(list(range(10)), "a")
    assert run_prefill(bm, a) == []
    b = make_request(list(range(9)) + [99], "b")  # shares 9 tokens = 2 full blocks
    hits = run_prefill(bm, b)
    assert hits == bm.block_table("a")[:2]
    # A prompt made only of cached full blocks keeps its last block to compute.
    c = make_request(list(range(8)), "c")
    assert bm.match_prefix(c) == bm.block_table("a")[:1]


def test_scheduler_counts_a_prefix_hit_as_cached_and_computed():
    sched = scheduler_with(num_blocks=16, caching=True)
    sched.add(make_request(list(range(10)), "a"))
    complete_step(sched, sched.schedule())
    b = make_request(list(range(9)) + [99], "b")  # shares 9 tokens = 2 full blocks
    sched.add(b)
    step = sched.schedule()
    assert step.requests[-1] is b and step.num_new_tokens[-1] == 2
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8


def test_prefix_chain_depends_on_whole_prefix():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    run_prefill(bm, make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    # Same second block, different first block: no hit.
    assert bm.match_prefix(make_request([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")) == []


def test_only_requests_with_the_same_cache_salt_share_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(9))
    run_prefill(bm, make_request(tokens, "tenant-a", cache_salt="a"))
    assert len(bm.match_prefix(make_request(tokens, "a2", cache_salt="a"))) == 2
    assert bm.match_prefix(make_request(tokens, "b", cache_salt="b")) == []
    assert bm.match_prefix(make_request(tokens, "unsalted")) == []
    run_prefill(bm, make_request(tokens, "plain"))
    assert len(bm.match_prefix(make_request(tokens, "plain2"))) == 2
    assert bm.match_prefix(make_request(tokens, "c", cache_salt="c")) == []


def test_freed_cached_blocks_survive_until_needed_then_get_evicted():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    a = make_request(list(range(9)), "a")
    run_prefill(bm, a)
    bm.release("a")
    again = make_request(list(range(9)), "a2")
    assert len(bm.match_prefix(again)) == 2  # still cached after release
    other = make_request([50 + i for i in range(12)], "o")
    run_prefill(bm, other)  # needs all 3 blocks: evicts the cached ones
    assert bm.match_prefix(make_request(list(range(9)), "a3")) == []


def test_shared_block_is_not_freed_while_referenced():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_request(list(range(9)), "a")
    run_prefill(bm, a)
    b = make_request(list(range(9)), "b")
    run_prefill(bm, b)
    shared = bm.block_table("a")[0]
    assert bm.block_table("b")[0] == shared and bm.blocks[shared].ref_count == 2
    bm.release("a")
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free


def scheduler_with(num_blocks, block_size=4, max_num_seqs=4, budget=64, chunked=False, caching=False):
    # A clock that never moves measures no step cost, so the steps here do not depend on how fast this machine
    # runs them (tests/test_prefill_budget.py times steps with a fake clock).
    return Scheduler(BlockManager(num_blocks, block_size, caching), max_num_seqs, budget, chunked, clock=lambda: 0.0)


def complete_step(sched, step):
    """The runner's part: every request that catches up with its tokens gets a generated token 7."""
    sched.update_from_output(step, ModelRunnerOutput([7] * len(step.samplers)))


def test_budget_and_max_num_seqs():
    sched = scheduler_with(num_blocks=64, max_num_seqs=2, budget=64)
    reqs = [make_request(range(10), str(i)) for i in range(3)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert batch.requests == reqs[:2] and batch.num_new_tokens == [10, 10]
    assert [r.status for r in reqs] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]
    complete_step(sched, batch)
    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1]  # decode steps; the third still waits for a free seat


def test_chunked_prefill_splits_long_prompt_over_steps():
    sched = scheduler_with(num_blocks=64, budget=8, chunked=True)
    r = make_request(range(20))
    sched.add(r)
    seen = []
    while r.num_computed_tokens < 20:
        batch = sched.schedule()
        seen.append(batch.num_new_tokens[0])
        complete_step(sched, batch)
    assert seen == [8, 8, 4]


def test_without_chunking_a_prompt_over_budget_waits():
    sched = scheduler_with(num_blocks=64, budget=8, chunked=False)
    sched.add(make_request(range(6), "short"))
    sched.add(make_request(range(20), "long"))
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["short"]


def test_preemption_frees_newest_request_and_it_resumes():
    # 4 blocks of 4 tokens; two 8-token prompts take 2 blocks each; the first decode needs a 3rd.
    sched = scheduler_with(num_blocks=4, budget=64)
    a, b = make_request(range(8), "a"), make_request(range(100, 108), "b")
    sched.add(a)
    sched.add(b)
    complete_step(sched, sched.schedule())  # both prefilled, each with a 9th (generated) token
    batch = sched.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert batch.requests == [a] and sched.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and sched.block_manager.block_table("b") == []
    assert b.num_computed_tokens == 0
    assert b.token_ids[-1] == 7  # its generated token is kept for recompute
    sched.finish_request(a, "stop")
    batch = sched.schedule()
    assert batch.requests == [b] and batch.num_new_tokens == [9]


@pytest.mark.parametrize("caching", [False, True])
def test_scheduler_never_exceeds_pool(caching):
    rng = np.random.default_rng(0)
    sched = scheduler_with(num_blocks=12, block_size=4, max_num_seqs=4, budget=16, chunked=True, caching=caching)
    reqs = [make_request(rng.integers(0, 5, size=int(rng.integers(1, 15))).tolist(), str(i)) for i in range(10)]
    for r in reqs:
        sched.add(r)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert sum(batch.num_new_tokens) <= 16 and len(sched.running) <= 4
        used = sum(1 for blk in sched.block_manager.blocks if blk.ref_count > 0)
        assert used <= 12
        complete_step(sched, batch)
        for r in list(sched.running):
            if r.num_output_tokens >= 6:
                sched.finish_request(r, "stop")
    assert not sched.has_unfinished()


def test_sampling_batch_answers_what_the_arrays_give():
    """The scheduler answers greedy / untouched / plain-greedy itself when it builds the sampling rows: the
    same as computing them from the arrays, for greedy, sampled, banned and penalised rows."""
    def request(rid, outputs=(), eos=frozenset(), **params):
        r = Request(request_id=rid, prompt_token_ids=[1, 2, 3], params=SamplingParams(**params).with_model_defaults({}),
                    max_tokens=8, eos_token_ids=eos, generator=np.random.default_rng(0),
                    metrics=RequestMetrics(arrival_time=0.0))
        r.token_ids.extend(outputs)
        return r

    greedy = request("g", temperature=0)
    cases = [
        [greedy], [greedy, request("g2", outputs=[4], top_k=1)],
        [greedy, request("s", temperature=0.7, top_p=0.9)],  # a row that draws
        [request("m", temperature=0, min_tokens=2, eos=frozenset({2}))],  # EOS banned below min_tokens
        [request("p", temperature=0, repetition_penalty=1.2)],  # penalty over the prompt
        [request("f", temperature=0, frequency_penalty=0.5)],  # no output yet: nothing to act on
        [request("f2", outputs=[5], temperature=0, presence_penalty=0.5)],
    ]
    for requests in cases:
        kept = sampling_batch(requests)
        computed = dataclasses.replace(kept, greedy=None, plain=None, untouched=None)
        np.testing.assert_array_equal(kept.greedy_mask(), computed.greedy_mask())
        assert kept.plain_greedy() == computed.plain_greedy(), [r.request_id for r in requests]
        assert kept.untouched_logits() == computed.untouched_logits(), [r.request_id for r in requests]
    assert [sampling_batch(c).plain_greedy() for c in cases] == [True, True, False, False, False, True, False]
