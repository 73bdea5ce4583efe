"""A request's greedy output never depends on what else the engine is doing.

The reference is each prompt run alone, one request at a time; every other configuration must
reproduce it token for token.
"""
import itertools

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams

NUM_PROMPTS = 32
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_prompts():
    rng = np.random.default_rng(1234)
    shared = rng.integers(3, 1000, size=40).tolist()  # a common prefix for prefix caching
    prompts = []
    for i in range(NUM_PROMPTS):
        length = int(rng.integers(1, 90))
        tail = rng.integers(3, 1000, size=length).tolist()
        prompts.append(shared[: int(rng.integers(0, 41))] + tail if i % 2 else tail)
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def alone(tiny_hf):
    llm = LLM(model=tiny_hf, block_size=16, max_num_seqs=1, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs.token_ids for p in PROMPTS]


def run(model, **kwargs):
    llm = LLM(model=model, block_size=16, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.error_code for o in outputs] == [200] * NUM_PROMPTS
    return llm, [o.outputs.token_ids for o in outputs]


def test_alone_outputs_are_full_length(alone):
    assert all(len(t) == MAX_TOKENS for t in alone)
    assert len({tuple(t) for t in alone}) > NUM_PROMPTS // 2  # the prompts really differ


def test_batch_of_32_mixed_lengths(tiny_hf, alone):
    _, tokens = run(tiny_hf, max_num_seqs=32, enable_prefix_caching=False)
    assert tokens == alone


def test_small_kv_pool_preempts_and_recomputes(tiny_hf, alone):
    llm, tokens = run(tiny_hf, max_num_seqs=16, num_gpu_blocks_override=24, enable_prefix_caching=False,
                      kv_cache_ratio=1.0)  # no reserve: prompts take the whole pool, outputs then preempt
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens == alone


def test_kv_cache_ratio_keeps_a_reserve_that_spares_preemptions(tiny_hf, alone):
    """FastDeploy's kv_cache_ratio: while requests run, new prompts may take only that share of the pool, so
    the running requests' outputs grow into the rest instead of preempting each other."""
    preemptions = {}
    for ratio in (1.0, 0.75, 800 / (800 + 500)):  # FastDeploy's worked example: 800 prompt / 500 output tokens
        llm, tokens = run(tiny_hf, max_num_seqs=16, num_gpu_blocks_override=24, enable_prefix_caching=False,
                          kv_cache_ratio=ratio)
        assert tokens == alone
        preemptions[ratio] = llm.engine.scheduler.num_preemptions
    assert preemptions[1.0] > preemptions[0.75] >= preemptions[800 / 1300], preemptions


def test_chunked_prefill_small_budget(tiny_hf, alone):
    llm, tokens = run(tiny_hf, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=24,
                      enable_prefix_caching=False)
    assert tokens == alone


def test_prefix_caching(tiny_hf, alone):
    llm, tokens = run(tiny_hf, max_num_seqs=4, enable_prefix_caching=True, num_gpu_blocks_override=400)
    assert tokens == alone
    # Run again: now every prompt's full blocks are cached (the pool is big enough to keep them all),
    # and each request still computes at least its last prompt token.
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs.token_ids for o in again] == alone
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]


def test_everything_at_once(tiny_hf, alone):
    llm, tokens = run(tiny_hf, max_num_seqs=12, num_gpu_blocks_override=30, enable_chunked_prefill=True,
                      max_num_batched_tokens=40, enable_prefix_caching=True)
    assert tokens == alone


def test_default_chunked_prefill_cuts_prompts_beside_decoding_requests(tiny_hf, alone):
    """The default configuration: chunked prefill, whose prompt tokens are capped while requests decode. Staggered
    max_tokens (a greedy output cut short is the start of the whole one) finish requests at different steps, so
    prompts are admitted, and cut, beside decoding ones."""
    llm = LLM(model=tiny_hf, block_size=16, max_num_seqs=8)
    scheduler = llm.engine.scheduler
    ticks = itertools.count()
    # Every step "takes" 1 s whatever its size: no slope is measured, so the cap is the floor (16 tokens) or as
    # many prompt tokens as decode tokens, the same on any machine.
    scheduler.prefill_budget.clock = lambda: float(next(ticks))
    cut_beside_decodes = 0
    schedule = scheduler.schedule

    def watched():
        nonlocal cut_beside_decodes
        step = schedule()
        if 1 in step.num_new_tokens:
            cut_beside_decodes += sum(1 < n < r.num_tokens - r.num_computed_tokens
                                      for r, n in zip(step.requests, step.num_new_tokens))
        return step

    scheduler.schedule = watched
    params = [SamplingParams(temperature=0, max_tokens=1 + i % MAX_TOKENS, ignore_eos=True) for i in range(NUM_PROMPTS)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs.token_ids for o in outputs] == [t[:1 + i % MAX_TOKENS] for i, t in enumerate(alone)]
    assert cut_beside_decodes > 10
