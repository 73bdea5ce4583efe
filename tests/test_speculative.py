"""Speculative decoding (issue 44): ngram drafts, verified in the same step, change nothing but the speed.

The reference is the same LLM without speculative_config: every request's tokens must be the same, greedy or
sampled (a seeded request's output position always inverts the same uniform), while drafts were accepted.
"""
from __future__ import annotations

from array import array

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.speculative import Drafter, MtpDrafter, NgramDrafter, SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "max_ngram_size": 3, "min_ngram_size": 1}


def naive_proposal(tokens: list[int], k: int, min_n: int, max_n: int, then: list[int] = ()) -> list[int]:
    """The rule written out: the longest suffix of max..min tokens of the context followed by `then` that occurred
    in the context before (ending before its last token), its most recent such occurrence, and the k tokens after
    it in the sequence continued as if it repeated from there on."""
    seq, last = tokens + list(then), len(tokens) - 1
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        suffix = seq[len(seq) - n:]
        for end in range(last, n - 1, -1):
            if tokens[end - n:end] == suffix:
                repeated = list(seq)
                while len(repeated) < end + k:  # the suffix recurs every len(seq) - end tokens
                    repeated.append(repeated[len(repeated) - (len(seq) - end)])
                return repeated[end:end + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_drafter_proposes_what_the_rule_says_as_tokens_arrive(seed: int) -> None:
    rng = np.random.default_rng(seed)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5,
                                          "max_ngram_size": int(rng.integers(1, 5)), "min_ngram_size": 1})
    drafter = NgramDrafter(config)
    tokens = rng.integers(0, 6, size=int(rng.integers(1, 30))).tolist()
    proposed = 0
    for _ in range(80):
        expected = naive_proposal(tokens, 5, config.min_ngram_size, config.max_ngram_size)
        assert drafter.propose(tokens, 5) == expected, tokens
        proposed += bool(expected)
        tokens += rng.integers(0, 6, size=int(rng.integers(1, 4))).tolist()  # a step emits 1..3 tokens
    assert proposed > 40


def test_drafter_continues_a_loop_past_the_end_of_the_context() -> None:
    def propose(tokens: list[int], limit: int, then: list[int] = ()) -> list[int]:
        return NgramDrafter(SpeculativeConfig.from_dict(NGRAM)).propose(tokens, limit, then)

    assert propose([9, 1, 2, 1, 2], 4) == [1, 2, 1, 2]  # "1 2" recurs every 2 tokens
    assert propose([9, 1, 2, 1, 2, 1], 3) == [2, 1, 2]
    assert propose([4, 4, 4, 4], 4) == [4, 4, 4, 4]
    assert propose([5, 6, 7, 8, 5, 6], 4) == [7, 8, 5, 6]  # the earlier text, then the loop again
    assert propose([5, 6, 7, 8, 5, 6], 4, [7]) == [8, 5, 6, 7]  # over unverified drafts too


def test_drafter_follows_tokens_taken_back_and_never_matches_across_token_boundaries() -> None:
    drafter = NgramDrafter(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                                        "max_ngram_size": 2, "min_ngram_size": 1}))
    tokens = [7, 8, 9, 3, 7]
    assert drafter.propose(tokens, 3) == [8, 9, 3]
    del tokens[-2:]  # a stop string's tokens taken back (Scheduler.take_back), then others emitted
    drafter.rewind(len(tokens))
    tokens += [5, 9]
    assert drafter.propose(tokens, 3) == naive_proposal(tokens, 3, 1, 2) == [5, 9, 5]
    # Packed little-endian, [1, 0] is 01 00 00 00 00 00 00 00, which [256, 0, 256] holds one byte in: no occurrence.
    drafter = NgramDrafter(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                                        "max_ngram_size": 2, "min_ngram_size": 2}))
    tokens = [256, 0, 256, 1, 0]
    assert bytes(array("i", tokens[:4])).find(bytes(array("i", [1, 0]))) % 4 != 0
    assert drafter.propose(tokens, 2) == naive_proposal(tokens, 2, 2, 2) == []


@pytest.mark.parametrize("seed", range(4))
def test_drafter_extends_unverified_drafts_without_indexing_them(seed: int) -> None:
    """MTP's "with_ngram" strategy: the lookup runs over the context followed by the MTP drafts, which are never
    indexed (they may be rejected), so the next lookups still follow the rule over the real tokens alone."""
    rng = np.random.default_rng(seed)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5, "max_ngram_size": 3,
                                          "min_ngram_size": 1})
    drafter = NgramDrafter(config)
    tokens = rng.integers(0, 5, size=8).tolist()
    extended = 0
    for _ in range(60):
        then = rng.integers(0, 5, size=int(rng.integers(0, 3))).tolist()
        expected = naive_proposal(tokens, 4, 1, 3, then)
        assert drafter.propose(tokens, 4, then) == expected, (tokens, then)
        assert drafter.propose(tokens, 4) == naive_proposal(tokens, 4, 1, 3)
        extended += bool(then and expected)
        tokens += rng.integers(0, 5, size=int(rng.integers(1, 3))).tolist()
    assert extended > 20


def test_mtp_steps_follow_fastdeploys_options() -> None:
    def steps(**given) -> int:
        return SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 4, **given}).mtp_steps

    assert steps() == 4  # the layer drafts them all, chained
    assert steps(num_model_steps=2) == 2
    assert steps(mtp_strategy="with_ngram") == 1  # FastDeploy's default num_model_steps; n-grams add the rest
    assert steps(mtp_strategy="with_ngram", num_model_steps=3) == 3
    drafter = MtpDrafter(SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 4,
                                                      "mtp_strategy": "with_ngram"}))
    tokens = [5, 6, 7, 8, 9, 5, 6]
    drafter.offer([7], len(tokens), [])
    assert drafter.propose(tokens, 4) == [7, 8, 9, 5]  # the MTP draft, then what followed 5 6 7 before
    assert drafter.propose(tokens, 1) == [7]
    assert drafter.propose(tokens + [3], 4) == []  # the MTP draft is stale and 6 7 3 never occurred
    drafter.offer([1], len(tokens), [])
    assert drafter.propose(tokens, 4) == [1]  # 6 1 never occurred: no n-gram extension


@pytest.mark.parametrize("given, error, match", [
    ({"method": "mtp", "num_speculative_tokens": 2, "num_model_steps": 3}, ValueError, "num_model_steps must"),
    ({"method": "mtp", "num_model_steps": 0}, ValueError, "num_model_steps must"),
    ({"method": "mtp", "mtp_strategy": "tree"}, ValueError, "mtp_strategy must be one of"),
    ({"method": "ngram", "mtp_strategy": "with_ngram"}, ValueError, "method 'mtp' only"),
    ({"method": "ngram", "num_model_steps": 2}, ValueError, "method 'mtp' only"),
    ({"method": "mtp", "quantization": "wint4"}, NotImplementedError, "quantization"),
    ({"method": "eagle"}, ValueError, "method must be one of"),
    ({"num_speculative_tokens": 2}, ValueError, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "min_ngram_size": 4, "max_ngram_size": 3}, ValueError, "min_ngram_size"),
    ({"method": "ngram", "lookahead": 3}, ValueError, "unknown keys"),
    ({"method": "ngram", "model": "/somewhere"}, ValueError, "method 'mtp' only"),
    ({"method": "mtp", "model": 3}, ValueError, "directory of the MTP weights"),
    ("ngram", TypeError, "must be a dict"),
])
def test_bad_speculative_config_is_refused(given, error, match) -> None:
    with pytest.raises(error, match=match):
        SpeculativeConfig.from_dict(given)


def test_fastdeploy_and_vllm_spellings() -> None:
    assert SpeculativeConfig.from_dict({"method": "ngram_match", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("ngram", 3, 5, 2)
    assert SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 3}) == \
        SpeculativeConfig("ngram", 4, 4, 3)


def repeating_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a span of themselves, so the context has something to copy."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        span = rng.integers(3, 1000, size=int(rng.integers(4, 12))).tolist()
        prompts.append(rng.integers(3, 1000, size=int(rng.integers(1, 20))).tolist() + span * 3 + span[:2])
    return prompts


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.error_code for o in outputs] == [200] * len(outputs), [o.error_msg for o in outputs]
    return outputs


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampled requests, penalties, min_tokens, bad words, stop ids and different lengths."""
    kinds = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=7), dict(temperature=1.0, top_k=20, seed=3),
             dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.2), dict(temperature=0, min_tokens=9),
             dict(temperature=0.7, presence_penalty=0.5, seed=11), dict(temperature=0, bad_words_token_ids=[5, 6])]
    return [SamplingParams(max_tokens=8 + 3 * (i % 5), **kinds[i % len(kinds)]) for i in range(n)]


class OracleDrafter(Drafter):
    """Drafts a request's true continuation (the run without speculation) with some tokens changed: the
    verification must keep exactly the right ones, whatever the drafts."""

    def __init__(self, expected: list, rng: np.random.Generator) -> None:
        self.reference = [o.prompt_token_ids + o.outputs.token_ids for o in expected]
        self.rng = rng

    def __call__(self, config):  # the engine's NgramDrafter(config)
        Drafter.__init__(self, config)
        self.k = 5  # drafts at most
        return self

    def length(self, threshold: float, probe: bool = False) -> int:
        return self.k  # every draft verified: the test is of the verification

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        # The continuation of a run that so far agrees (n > 1 samples of a prompt differ), else none.
        full = next((f for f in self.reference if f[:len(tokens)] == list(tokens)), [])
        drafts = full[len(tokens):len(tokens) + min(limit, int(self.rng.integers(1, 6)))]
        return [t if self.rng.random() < 0.8 else int(self.rng.integers(3, 1000)) for t in drafts]


def use_oracle(monkeypatch, expected: list, seed: int) -> None:
    """The engine drafts with OracleDrafter, in every step: the tests are of the verification, not of when drafting
    pays (which follows measured step times)."""
    from fastdeploy.engine.drafting import DraftPacing

    monkeypatch.setattr("fastdeploy.engine.engine.NgramDrafter", OracleDrafter(expected, np.random.default_rng(seed)))
    monkeypatch.setattr(DraftPacing, "verifies", lambda pacing, requests, step: True)


def model_path(name: str) -> str:
    from tests.conftest import FIXTURES

    return str(FIXTURES / "models" / name)


@pytest.mark.parametrize("model, quantization", [("ernie45_tiny_hf", None), ("ernie45_moe_tiny_hf", None),
                                                 ("qwen3_tiny", None), ("ernie45_tiny_hf", "wint4")])
def test_verification_keeps_exactly_the_tokens_without_speculation(model, quantization, monkeypatch) -> None:
    prompts = repeating_prompts(12, seed=len(model))
    params = mixed_params(len(prompts))
    base = dict(model=model_path(model), block_size=16, max_num_seqs=8, quantization=quantization)
    expected = generate(LLM(**base), prompts, params)
    use_oracle(monkeypatch, expected, 0)
    got = generate(LLM(**base, speculative_config=NGRAM), prompts, params)
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    assert [o.outputs.text for o in got] == [o.outputs.text for o in expected]
    assert [o.outputs.finish_reason for o in got] == [o.outputs.finish_reason for o in expected]
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert 0.4 * drafted < accepted < drafted, (accepted, drafted)  # rejections happened, and acceptances


def oracle_run(monkeypatch, prompts, params, **engine):
    """The outputs without and with speculation (drafts from the run without) under the same engine settings."""
    expected = generate(LLM(**engine), prompts, params)
    use_oracle(monkeypatch, expected, 1)
    llm = LLM(**engine, speculative_config=NGRAM)
    return expected, generate(llm, prompts, params), llm


def test_with_logprobs_stop_strings_bias_samples_preemption_and_chunks(monkeypatch) -> None:
    """A small KV pool (requests preempted and recomputed), chunked prefill with a small budget, prefix caching
    with n=2 samples of a prompt, logprobs and prompt logprobs, a stop string inside what a step's drafts
    bring, logit bias: the same outputs, logprobs included. The prompt cap is the one for an unmeasured step line,
    so that how many prompts share the pool (and preemption) does not follow the machine's step times."""
    from fastdeploy.engine.scheduler import PrefillBudget

    monkeypatch.setattr(PrefillBudget, "line", lambda budget, table=None: None)
    prompts = repeating_prompts(8, seed=5)
    engine = dict(model=model_path("ernie45_tiny_hf"), block_size=16, max_num_seqs=6, enable_chunked_prefill=True,
                  max_num_batched_tokens=24, num_gpu_blocks_override=9, kv_cache_ratio=1.0,
                  enable_prefix_caching=True)
    plain = generate(LLM(**engine), prompts, [SamplingParams(temperature=0, max_tokens=20)] * len(prompts))
    stops = [o.outputs.text[len(o.outputs.text) // 2:][:3] or None for o in plain]  # a cut half-way, often
    params = [SamplingParams(max_tokens=20, temperature=0.9 if i % 2 else 0, seed=i, n=2 if i % 3 == 0 else 1,
                             logprobs=2 if i % 4 == 1 else None, prompt_logprobs=1 if i == 2 else None,
                             stop=[stops[i]] if stops[i] and i % 2 == 0 else None,
                             logits_processors_args={"logit_bias": {7: 2.0}} if i == 3 else None) for i in range(len(prompts))]
    expected, got, llm = oracle_run(monkeypatch, prompts, params, **engine)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(o.outputs.finish_reason == "stop" for o in expected)
    assert_same_outputs(got, expected)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


def assert_same_outputs(got: list, expected: list) -> None:
    """Tokens, text, finish reasons, logprobs and prompt logprobs all the same."""
    for a, b in zip(got, expected, strict=True):
        assert a.outputs.token_ids == b.outputs.token_ids and a.outputs.text == b.outputs.text
        assert a.outputs.finish_reason == b.outputs.finish_reason
        assert a.outputs.logprobs == b.outputs.logprobs and a.prompt_logprobs == b.prompt_logprobs


def test_tensor_parallel_two_ranks(monkeypatch) -> None:
    prompts = repeating_prompts(6, seed=9)
    params = mixed_params(len(prompts))
    expected, got, _ = oracle_run(monkeypatch, prompts, params, model=model_path("ernie45_moe_tiny_hf"),
                                  tensor_parallel_size=2, block_size=16)
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


def test_guided_requests_draft_within_their_grammar(monkeypatch) -> None:
    """Guided decoding with drafts: a request's drafts are cut to what its grammar allows and each of its rows is
    masked as the grammar stands after the drafts before it; outputs are those without speculation."""
    from fastdeploy.engine.sampling_params import GuidedDecodingParams

    prompts = repeating_prompts(6, seed=3)
    specs = [GuidedDecodingParams(regex="[0-9]{4,40}"), GuidedDecodingParams(regex="(ab|cd|[0-9])+"),
             GuidedDecodingParams(choice=["alpha beta gamma", "delta epsilon"]), None]
    params = [SamplingParams(max_tokens=24, guided_decoding=specs[i % 4], seed=i,
                             temperature=0 if i % 2 == 0 else 0.8) for i in range(len(prompts))]
    expected, got, _ = oracle_run(monkeypatch, prompts, params, model=model_path("ernie45_tiny_hf"), block_size=16)
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    assert [o.outputs.text for o in got] == [o.outputs.text for o in expected]
    assert [o.outputs.finish_reason for o in got] == [o.outputs.finish_reason for o in expected]
    guided = [o for o, p in zip(got, params) if p.guided_decoding is not None]
    assert sum(o.metrics.num_accepted_tokens for o in guided) > 10
    assert sum(o.metrics.num_draft_tokens - o.metrics.num_accepted_tokens for o in guided) > 0


def test_reasoning_limits_with_drafts(monkeypatch) -> None:
    """Drafts that run past a request's thinking budget are taken back where the end of thinking is forced (their
    uniforms too): greedy and seeded outputs, and the reasoning/answer split, are those without speculation."""
    prompts = repeating_prompts(6, seed=11)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, reasoning_max_tokens=3 + 2 * i, seed=i,
                             temperature=0 if i % 2 else 0.9) for i in range(len(prompts))]
    expected, got, _ = oracle_run(monkeypatch, prompts, params, model=model_path("ernie45_tiny_hf"), block_size=16,
                                  reasoning_parser="ernie-x1")
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    assert [(o.outputs.reasoning_content, o.outputs.text) for o in got] == \
        [(o.outputs.reasoning_content, o.outputs.text) for o in expected]
    assert all("</think>" not in o.outputs.reasoning_content for o in got)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 10


def test_ngram_drafts_on_the_demo_model_are_accepted_and_change_nothing(monkeypatch) -> None:
    """The real drafter on the bundled model: its Python-documentation prose repeats itself enough for
    prompt lookup to be right often; greedy and seeded outputs are the same as without. Every request drafts
    all it finds in every step: how many drafts pay follows measured step times (test_draft_length_... and
    test_a_batch_drafts_... check those rules), which would make the count below depend on the machine's load."""
    from pathlib import Path

    from fastdeploy.engine.drafting import DraftPacing

    monkeypatch.setattr(Drafter, "length", lambda drafter, threshold, probe=False: drafter.k)
    monkeypatch.setattr(DraftPacing, "verifies", lambda pacing, requests, step: True)

    demo = str(Path(__file__).parents[1] / "models" / "ernie-4.5-demo")
    prompts = ["The list type is a mutable sequence type. The list type", "class C:\n    def __init__(self, value):\n"]
    params = [SamplingParams(temperature=0, max_tokens=60), SamplingParams(temperature=0.7, seed=2, max_tokens=60)]
    expected = LLM(model=demo, max_model_len=512).generate(prompts * 2, params * 2, use_tqdm=False)
    got = LLM(model=demo, max_model_len=512, speculative_config={"method": "ngram", "num_speculative_tokens": 4}
              ).generate(prompts * 2, params * 2, use_tqdm=False)
    assert [o.outputs.token_ids for o in got] == [o.outputs.token_ids for o in expected]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 10, sum(o.metrics.num_accepted_tokens for o in got)


def test_draft_length_follows_acceptance_and_the_steps_cost() -> None:
    """The j-th draft is verified while a^j beats the threshold (a: acceptance with a 1/2 prior); a request
    whose drafts do not pay still drafts one token on the scheduler's probe steps (every PROBE_EVERY-th, the same
    for every request)."""
    from fastdeploy.engine.block_manager import BlockManager
    from fastdeploy.engine.scheduler import Scheduler
    from fastdeploy.engine.drafting import PROBE_EVERY

    drafter = Drafter(SpeculativeConfig("ngram", 4))
    assert drafter.length(0.0) == 4 and drafter.length(0.49) == 1 and drafter.length(0.5) == 0
    drafter.record(98, 88)  # a = 0.89: 0.89, 0.79, 0.70, 0.63
    assert [drafter.length(t) for t in (0.1, 0.65, 0.75, 0.85)] == [4, 3, 2, 1]
    assert [drafter.length(0.95, probe) for probe in (False, True)] == [0, 1]
    assert drafter.length(0.1, probe=True) == 4 and drafter.length(1.0, probe=True) == 1
    scheduler = Scheduler(BlockManager(64, 16, False), 64, 2048, True, speculative=True)
    scheduler.prefill_budget.seconds.update({1: 0.011, 16: 0.026, 64: 0.074})  # threshold 0.68 at 16 requests
    idle = Drafter(SpeculativeConfig("ngram", 4))
    idle.record(100, 0)
    lengths = []
    for _ in range(3 * PROBE_EVERY):
        scheduler.running = []
        scheduler.schedule()
        scheduler.running = [object()] * 16
        lengths.append(scheduler.pacing.worth(idle, scheduler.num_steps, len(scheduler.running)))
    assert lengths == ([0] * (PROBE_EVERY - 1) + [1]) * 3


def test_draft_threshold_from_the_measured_step_line() -> None:
    """The threshold from the line of all steps; decoding steps are timed apart too when steady (moved on, or with
    drafts: what DraftPacing weighs)."""
    from fastdeploy.engine.drafting import draft_threshold
    from fastdeploy.engine.scheduler import PrefillBudget

    budget = PrefillBudget(2048)
    assert draft_threshold(budget.line(), 16) == 0.0  # the line is not known yet
    budget.seconds.update({1: 0.011, 16: 0.026, 64: 0.074})  # 10 ms fixed, 1 ms per token
    assert draft_threshold(budget.line(), 16) == pytest.approx(1.1 * 16 / 26, rel=1e-6)  # with the 10 % margin
    assert draft_threshold(budget.line(), 1) == pytest.approx(1.1 * 1 / 11, rel=1e-6)
    assert draft_threshold(budget.line(), 128) == 1.0  # 1.1 x 128 / 138 > 1: compute-bound, nothing pays
    budget = PrefillBudget(2048, clock=iter([0.0, 1.0, 1.003, 1.005, 1.01, 1.02, 1.023]).__next__)  # at step starts
    for tokens, timing in ((512, None), (2, "steady"), (4, "steady"), (8, "steady"), (8, "steady"), (4, "settling")):
        budget.step_begins()  # the first step is not counted
        budget.step_scheduled(tokens, timing)
        budget.step_applied(more_work=True)
    assert list(budget.decode_seconds.items())[:2] == [(2, pytest.approx(0.003)), (4, pytest.approx(0.002))]
    assert budget.decode_seconds[8] == pytest.approx(0.005 + (0.01 - 0.005) / 16)  # slower: moved by a sixteenth
    budget.step_begins()
    assert budget.settling == pytest.approx(0.25 * (0.003 - 0.002)) and budget.decode_seconds[4] == pytest.approx(0.002)
    assert set(budget.seconds) == {2, 4, 8}
    assert budget.line(budget.decode_seconds)[1] == pytest.approx(
        np.polyfit([2, 4, 8], [0.003, 0.002, 0.005 + 0.005 / 16], 1)[0])


class Steps:
    """Measured step times for DraftPacing: decoding steps' by size, and the line."""

    def __init__(self, decode_seconds: dict[int, float], line: tuple[float, float] | None = None) -> None:
        self.decode_seconds, self._line, self.settling = decode_seconds, line, 0.0

    def line(self, table=None):
        return self._line


def test_a_batch_verifies_drafts_while_they_pay_for_a_drafting_steps_cost() -> None:
    """What a step with drafts gains (its requests' lookups: how often each finds drafts, how many it verifies and
    keeps; each token worth a plain step's time over the batch) against what its drafts cost by the decoding steps'
    line, plus the settling of the step after. A plain step of the batch is measured first; without a line the
    drafting size's own time is read, and with neither, the step verifies to measure."""
    from types import SimpleNamespace

    from fastdeploy.engine.block_manager import BlockManager
    from fastdeploy.engine.drafting import DraftPacing

    def batch(hit: float, reach: float, gain: float, n: int = 16) -> list:
        requests = []
        for _ in range(n):
            drafter = Drafter(SpeculativeConfig("ngram", 4))
            drafter.hit, drafter.reach, drafter.gain = hit, reach, gain
            requests.append(SimpleNamespace(drafter=drafter))
        return requests

    def verifies(requests: list, seconds: dict[int, float], line: tuple[float, float] | None = None,
                 settling: float = 0.0) -> bool:
        steps = Steps(seconds, line)
        steps.settling = settling
        return DraftPacing(BlockManager(8, 16, False), steps).verifies(requests, step=1)

    plain = {16: 0.0016}  # a token is worth 1.6 / 16 = 0.1 ms
    rare = batch(hit=0.05, reach=1.0, gain=0.5)  # a step with drafts has ~1.4 of them and gains 0.7 tokens: 0.07 ms
    assert not verifies(rare, plain, line=(0.001, 0.0001)) and verifies(rare, plain, line=(0.001, 0.00001))
    assert not verifies(rare, plain, line=(0.001, 0.00001), settling=0.0001)  # the step after costs 0.1 ms more
    assert not verifies(rare, {17: 0.0017}, line=(0.001, 0.00001))  # a plain step of the batch is measured first
    assert verifies(rare, plain) and not verifies(rare, {**plain, 17: 0.0020})  # no line: the size's own time
    copying, sampled = batch(0.9, 4.0, 3.5), batch(0.9, 4.0, 1.0)  # steps with 64 drafts: 4.4 ms more
    assert verifies(copying, plain, line=(0.0, 0.00007))  # 50 tokens, 5 ms
    assert not verifies(sampled, plain, line=(0.0, 0.00007))  # 14 tokens, 1.4 ms
    one = batch(0.2, 4.0, 3.0, n=1)  # a lookup seldom finds drafts, but those it finds pay: 3 x 0.26 ms, 0.04 ms
    assert verifies(one, {1: 0.00026}, line=(0.00026, 0.00001))


def test_watched_drafts_count_what_verifying_them_would_have_kept() -> None:
    drafter = NgramDrafter(SpeculativeConfig.from_dict(NGRAM))
    drafter.watch([5, 6, 7, 8])
    assert drafter.hit == 1.0 and drafter.reach == 1.75
    drafter.witness([5])
    drafter.witness([6])
    assert drafter.watched and drafter.gain == 1.0  # two came true so far: not settled
    drafter.witness([9])  # the third did not: verifying would have kept 2
    assert not drafter.watched and drafter.gain == pytest.approx(1.25)
    drafter.watch([])  # a lookup that finds nothing
    assert drafter.hit == pytest.approx(0.75) and not drafter.watched
    drafter.watch([1, 2])
    drafter.witness([1, 2, 3])  # a step of three tokens: both came true
    assert not drafter.watched and drafter.gain == pytest.approx(1.25 + 0.25 * (2 - 1.25))
    drafter.watch([4])
    drafter.rewind(3)  # tokens taken back: what is watched no longer follows the context
    assert not drafter.watched


def test_the_engine_watches_drafts_while_verifying_them_does_not_pay(monkeypatch) -> None:
    """The pacing wired into the scheduler, its measured step times replaced (a plain step 1 ms, a draft 4 ms or
    0.01 ms by the line): while a draft costs more than it can gain, no step drafts, yet the drafts are watched (and
    found to come true); once drafts are cheap, they are verified. The tokens are those without speculation."""
    from pathlib import Path

    demo = str(Path(__file__).parents[1] / "models" / "ernie-4.5-demo")
    prompt = ["The list type is a mutable sequence type. The list type"]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    expected = LLM(model=demo, max_model_len=512).generate(prompt, params, use_tqdm=False)[0].outputs.token_ids
    llm = LLM(model=demo, max_model_len=512, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    scheduler = llm.engine.scheduler
    cost = {"per_token": 0.004}  # seconds a draft adds to a step, by the line
    budget = scheduler.prefill_budget

    class Table(dict):  # a plain step of the batch takes 1 ms
        def get(self, size, default=None):
            return 0.001

    budget.decode_seconds = Table()
    monkeypatch.setattr(budget, "line", lambda table=None: (0.001, cost["per_token"]))
    gains: list[float] = []
    watch = NgramDrafter.watch
    monkeypatch.setattr(NgramDrafter, "watch", lambda drafter, drafts: gains.append(drafter.gain) or
                        watch(drafter, drafts))
    for per_token, verified in ((0.004, False), (0.00001, True)):
        cost["per_token"], gains[:] = per_token, []
        got = llm.generate(prompt, params, use_tqdm=False)[0]
        assert got.outputs.token_ids == expected
        if verified:
            assert got.metrics.num_accepted_tokens > 10
        else:
            # Watched, one draft at a time (a draft's cost by the line allows no more), all kept.
            assert got.metrics.num_draft_tokens == 0 and len(gains) > 10 and min(gains) == 1.0, gains


def test_which_requests_look_up_in_a_step() -> None:
    """Every PROBE_EVERY-th step each lookup request looks up; between them, one whose lookups seldom find drafts
    does not, and while the batch verifies nothing, only one whose watched drafts came true looks up again."""
    from fastdeploy.engine.block_manager import BlockManager
    from fastdeploy.engine.drafting import PROBE_EVERY, DraftPacing
    from fastdeploy.engine.request import Request, RequestMetrics
    from fastdeploy.engine.sampling_params import SamplingParams as Params

    request = Request(request_id="r", prompt_token_ids=[5, 6, 7, 5, 6], params=Params(temperature=0).with_model_defaults(
        {}), max_tokens=20, eos_token_ids=frozenset({1}), generator=np.random.default_rng(0),
        metrics=RequestMetrics(arrival_time=0.0))
    calls = []

    class Counting(NgramDrafter):
        def propose(self, tokens, limit, then=()):
            calls.append(len(tokens))
            return super().propose(tokens, limit, then)

    request.drafter = Counting(SpeculativeConfig.from_dict(NGRAM))
    manager = BlockManager(8, 16, False)
    manager.allocate(request, 5)
    pacing = DraftPacing(manager, Steps({1: 0.001}))

    assert pacing.draft(request, 8, verify=True, step=1, batch=1) == 4 and request.draft_token_ids == [7, 5, 6, 7]
    request.draft_token_ids = []
    request.drafter.hit = 0.1  # seldom finds drafts
    assert pacing.draft(request, 8, True, 2, 1) == 0 and len(calls) == 1
    assert pacing.draft(request, 8, True, PROBE_EVERY, 1) == 4 and len(calls) == 2
    request.draft_token_ids, request.drafter.hit = [], 1.0
    assert pacing.draft(request, 8, verify=False, step=9, batch=1) == 0 and len(calls) == 2  # never watched: waits
    assert pacing.draft(request, 8, False, 2 * PROBE_EVERY, 1) == 0 and request.drafter.watched == [7, 5, 6, 7]
    request.drafter.witness([7, 5, 6, 7])  # they came true
    assert pacing.draft(request, 8, False, 2 * PROBE_EVERY + 1, 1) == 0 and len(calls) == 4 and request.drafter.watched
    request.drafter.witness([9])  # these did not
    assert pacing.draft(request, 8, False, 2 * PROBE_EVERY + 2, 1) == 0 and len(calls) == 4
