"""A decoding batch moved on in place (engine/step_builder.py) against the same steps built anew."""
import dataclasses
import json
import types

import numpy as np
import pytest

from conftest import REFERENCE
from fastdeploy import LLM, SamplingParams as Params
from fastdeploy.engine.block_manager import BlockManager
from fastdeploy.engine.request import Request, RequestMetrics
from fastdeploy.engine.scheduler import Scheduler
from fastdeploy.engine.step_builder import SteadyDecode
from fastdeploy.speculative import Drafter
from fastdeploy.step_types import ModelRunnerOutput

PARAMS = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=5), dict(temperature=0, repetition_penalty=1.3),
          dict(temperature=0, min_tokens=4), dict(temperature=0.7, seed=9, logprobs=2)]


def world(num_blocks: int, budget: int, speculative: bool = False) -> tuple[Scheduler, list[Request]]:
    """A scheduler (block size 4: tables grow often) and five requests, one per kind of PARAMS."""
    scheduler = Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=False), max_num_seqs=4,
                          max_num_batched_tokens=budget, enable_chunked_prefill=True,
                          clock=lambda: 0.0, speculative=speculative)  # every step 0 s: both cut prompts alike
    requests = [Request(request_id=str(i), prompt_token_ids=list(range(3 + 2 * i)),
                        params=Params(**p).with_model_defaults({}), max_tokens=30 - 3 * i,
                        eos_token_ids=frozenset({1}), generator=np.random.default_rng(i),
                        metrics=RequestMetrics(arrival_time=0.0)) for i, p in enumerate(PARAMS)]
    return scheduler, requests


def assert_same(a, b, where: str) -> None:
    """Field by field, through dataclasses, lists and arrays."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


class EverySeventhDrafter(Drafter):
    """Drafts the last `limit` tokens again when the context's length is a multiple of 7: the same in both worlds."""

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        return list(tokens[-limit:]) if len(tokens) % 7 == 0 else []


@pytest.mark.parametrize("num_blocks, drafting", [(64, False), (9, False), (64, True), (9, True)])
def test_moved_on_steps_are_the_steps_built_anew(num_blocks: int, drafting: bool, monkeypatch) -> None:
    """Two schedulers over the same requests and tokens, one of them never moving a step on: every step's
    SchedulerOutput is the same, with requests joining, finishing, being preempted (9 blocks), forced tokens, a
    request below min_tokens, sampled and penalised rows, and drafting steps between (whose drafts jump a request
    across blocks of 4 tokens, some rejected and their blocks freed); and steps were moved on, block tables growing
    under them, right after drafting steps too."""
    from fastdeploy.engine.drafting import DraftPacing
    from fastdeploy.speculative import SpeculativeConfig

    monkeypatch.setattr(DraftPacing, "verifies", lambda pacing, requests, step: True)
    steady, steady_requests = world(num_blocks, budget=16, speculative=drafting)
    built, built_requests = world(num_blocks, budget=16, speculative=drafting)
    if drafting:
        for r in steady_requests + built_requests:
            r.drafter = EverySeventhDrafter(SpeculativeConfig("ngram", 3))
    built._steady = types.SimpleNamespace(advance=lambda *args: None, keep=lambda step: None, forget=lambda: None)
    rng = np.random.default_rng(0)
    moved = grown = widened = after_drafts = 0
    drafted = False
    for step_number in range(200):
        for world_requests, scheduler in ((steady_requests, steady), (built_requests, built)):
            if step_number % 7 == 0 and world_requests:  # requests arrive while others decode
                scheduler.add(world_requests.pop(0))
            if step_number == 20:  # what the output processor does for reasoning_max_tokens
                for r in scheduler.running[:1]:
                    r.forced_tokens = [11, 12]
        if not steady.has_unfinished() and not steady_requests:
            break
        kept = steady._steady.step
        width = kept.model_input.forward.block_tables.shape[1] if kept is not None else 0
        a, b = steady.schedule(), built.schedule()
        if kept is not None and a is kept:
            moved += 1
            after_drafts += drafted
            forward = a.model_input.forward  # only SteadyDecode may write the arrays it moves on
            for array in (forward.token_ids, forward.positions, forward.context_lens, forward.block_tables,
                          a.model_input.sampling.uniforms):
                with pytest.raises(ValueError, match="read-only"):
                    array[0] = array[0]
            grown += bool((a.model_input.forward.positions % 4 == 0).any())
            widened += a.model_input.forward.block_tables.shape[1] > width
        assert_same(a.model_input, b.model_input, f"step {step_number}")
        assert [r.request_id for r in a.samplers] == [r.request_id for r in b.samplers]
        tokens = []  # a draft is accepted (its token sampled) half the time
        for r in a.samplers:
            tokens += [d if rng.random() < 0.5 else int(rng.integers(2, 50)) for d in r.draft_token_ids]
            tokens.append(int(rng.integers(2, 50)))
        drafted = len(a.rows) > len(a.samplers)
        steady.update_from_output(a, ModelRunnerOutput(tokens))
        built.update_from_output(b, ModelRunnerOutput(tokens))
    assert not steady.has_unfinished() and not built.has_unfinished()
    assert moved > 10 and grown > 0 and widened > 0, (moved, grown, widened)
    assert (after_drafts >= 2) == drafting, (moved, after_drafts)
    assert (steady.num_preemptions > 0) == (num_blocks == 9)


class CountingSteadyDecode(SteadyDecode):
    __slots__ = ("moved",)

    def __init__(self) -> None:
        super().__init__()
        self.moved = 0

    def advance(self, *args):
        step = super().advance(*args)
        self.moved += step is not None
        return step


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_engine_decoding_moved_on_steps_gives_transformers_tokens(tiny_hf, max_num_seqs: int) -> None:
    """Through the engine and the compiled step (which keeps its batch while the arrays are the same): with
    4-token blocks the tables grow and widen under the moved-on steps, and the greedy tokens are still
    transformers' (committed reference)."""
    ref = json.loads((REFERENCE / "ernie45_tiny_greedy.json").read_text())
    llm = LLM(model=tiny_hf, block_size=4, max_num_seqs=max_num_seqs, dtype="float32")
    assert llm.engine.runner.compiled is not None
    steady = llm.engine.scheduler._steady = CountingSteadyDecode()
    params = Params(temperature=0, max_tokens=ref["max_new_tokens"], ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in ref["cases"]], params,
                           use_tqdm=False)
    assert [o.outputs.token_ids for o in outputs] == [c["output_token_ids"] for c in ref["cases"]]
    assert steady.moved > len(ref["cases"]) * (ref["max_new_tokens"] // 2) // max_num_seqs


def test_drafting_rows_that_take_the_argmax_share_one_batch_that_samples_alike() -> None:
    """A drafting step's rows that are all greedy on untouched logits get one shared read-only batch; any row that
    penalises, bans (bad words, below min_tokens at its position) or samples takes the built one; and the shared
    batch gives the built batch's tokens."""
    from fastdeploy.engine import step_builder
    from fastdeploy.sampling import policy
    from fastdeploy.sampling.reference import sample_numpy

    def request(**params) -> Request:
        return Request(request_id="r", prompt_token_ids=[3, 4, 5], params=Params(**params).with_model_defaults({}),
                       max_tokens=20, eos_token_ids=frozenset({1}), generator=np.random.default_rng(0),
                       metrics=RequestMetrics(arrival_time=0.0), token_ids=[3, 4, 5, 6])  # one output token

    plain = [request(temperature=0), request(top_k=1, temperature=0.7), request(temperature=0, min_tokens=3)]
    rows, offsets = [plain[0]] * 3 + [plain[1], plain[2]], [0, 1, 2, 0, 2]  # the last at output position 3
    shared = step_builder.sampling_batch(rows, offsets)
    assert shared is step_builder.sampling_batch(rows[:4] + [plain[0]], offsets) and shared.plain_greedy()
    assert step_builder.sampling_batch(rows, [0, 1, 2, 0, 1]) is not shared  # the last row below min_tokens
    built = policy.sampling_batch([r.params for r in rows], [r.prompt_token_ids for r in rows],
                                  [[] for _ in rows], [[] for _ in rows], lambda i: 0.0)
    logits = np.random.default_rng(1).standard_normal((len(rows), 50)).astype(np.float32)
    want = sample_numpy(logits.copy(), built, built.greedy_mask(), built.uniforms)
    np.testing.assert_array_equal(sample_numpy(logits.copy(), shared, shared.greedy_mask(), shared.uniforms), want)
    for other in (dict(temperature=0, repetition_penalty=1.2), dict(temperature=0, min_tokens=5),
                  dict(temperature=0, presence_penalty=0.5),
                  dict(temperature=0, bad_words_token_ids=[7]), dict(temperature=0.8, seed=1)):
        assert step_builder.sampling_batch([plain[0], request(**other)], [0, 1]) is not shared
