"""Sampler tests: draws (inverse CDF, frequencies against transformers' distributions), greedy rows, bans,
seeded rows independent of their batch, and input checks. The filters and penalties against their
references: test_sampler.py.
"""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import paddle
import pytest

from fastdeploy.sampling.sampler import Sampler
from fastdeploy.sampling.reference import draw
from fastdeploy.step_types import SamplingBatch

REF = json.loads((pathlib.Path(__file__).parent / "fixtures/reference/sampler_distributions.json").read_text())


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ------------------------------------------------------------ draws


def test_draw_inverse_cdf_edges() -> None:
    weights = np.zeros((3, 2500), dtype=np.float32)
    weights[:, [7, 1500, 2400]] = [1.0, 2.0, 1.0]
    u = np.array([0.0, np.nextafter(1.0, 0.0), 0.5])
    # u = 0 -> first positive token; u -> 1 -> last positive token; 0.5 -> middle of token 1500's span
    np.testing.assert_array_equal(draw(weights, u), [7, 2400, 1500])


def _max_chi_square(df: int) -> float:
    """Chi-square quantile at 1 - 1e-4 (Wilson-Hilferty)."""
    z = 3.719
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _check_frequencies(tokens: np.ndarray, expected: np.ndarray) -> None:
    n = tokens.size
    support = expected > 0
    counts = np.bincount(tokens, minlength=expected.size)
    assert counts[~support].sum() == 0, "a filtered-out token was drawn"
    freq = counts / n
    bound = 5 * np.sqrt(expected * (1 - expected) / n) + 1 / n
    assert (np.abs(freq - expected) <= bound).all(), (freq, expected)
    if support.sum() > 1:
        chi2 = (((counts - n * expected) ** 2)[support] / (n * expected[support])).sum()
        assert chi2 < _max_chi_square(int(support.sum()) - 1), chi2


@pytest.mark.parametrize("case", REF["filter_cases"], ids=lambda c: c["name"])
def test_sampled_frequencies_match_reference(case: dict) -> None:
    n = 3000  # rows sharing the logits and params, each with its own generator
    logits = np.tile(np.array(case["logits"], dtype=np.float32), (n, 1))
    b = SamplingBatch.from_lists(n, temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"],
                                 min_p=case["min_p"], seeds=range(1000, 1000 + n))
    _check_frequencies(Sampler()(logits, b), np.array(case["probs"]))


def test_one_generator_over_many_steps_matches_reference() -> None:
    case = next(c for c in REF["filter_cases"] if c["name"] == "all")
    logits = np.array([case["logits"]], dtype=np.float32)
    generator = np.random.default_rng(5)
    sampler = Sampler()

    def step() -> int:  # each step's batch draws the row's next uniform from the same generator
        b = SamplingBatch.from_lists(1, temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"],
                                     min_p=case["min_p"], generators=[generator])
        return sampler(logits, b)[0]

    tokens = np.array([step() for _ in range(2000)])
    _check_frequencies(tokens, np.array(case["probs"]))


def test_greedy_rows_take_argmax_without_randomness() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (4, 50)).astype(np.float32)
    gens = [np.random.default_rng(i) for i in range(4)]
    states = [g.bit_generator.state for g in gens]
    b = SamplingBatch.from_lists(4, temperature=[0.0, 1.0, 0.7, 1.0], top_p=[1.0, 0.0, 1.0, 0.9],
                                 top_k=[0, 0, 1, -1], generators=gens)
    out = Sampler()(logits, b)
    np.testing.assert_array_equal(out[:3], logits[:3].argmax(axis=1))
    assert [g.bit_generator.state for g in gens[:3]] == states[:3]  # greedy rows draw nothing
    assert gens[3].bit_generator.state != states[3]


def test_all_greedy_batch_on_paddle_tensor_takes_argmax() -> None:
    logits = np.random.default_rng(4).normal(0, 1, (6, 300)).astype(np.float32)
    logits[2, [10, 20]] = logits[2].max() + 1  # a tie: the first index wins, as in numpy
    b = SamplingBatch.from_lists(6, temperature=0.0, generators=[None] * 6)
    np.testing.assert_array_equal(Sampler()(paddle.to_tensor(logits), b), logits.argmax(axis=1))


def test_callers_logits_are_left_unchanged() -> None:
    logits = np.random.default_rng(8).normal(0, 1, (5, 40)).astype(np.float32)
    b = SamplingBatch.from_lists(5, temperature=[0.0, 0.7, 1.0, 0.0, 1.3], top_p=0.9, top_k=[0, 5, 0, 0, 3],
                                 repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5,
                                 prompt_token_ids=[[1, 2]] * 5, output_token_ids=[[3, 3, 4]] * 5,
                                 banned_token_ids=[[0, 7]] * 5, seeds=range(5))
    tensor, array = paddle.to_tensor(logits), logits.copy()
    Sampler()(tensor, b)
    Sampler()(array, b)
    np.testing.assert_array_equal(tensor.numpy(), logits)
    np.testing.assert_array_equal(array, logits)


def test_banned_ids_are_never_sampled() -> None:
    rng = np.random.default_rng(5)
    n, vocab = 600, 64
    base = rng.normal(0, 1, vocab).astype(np.float32)
    base[[3, 9]] = [6.0, 5.5]  # banned ids would otherwise dominate
    logits = np.tile(base, (n, 1))
    b = SamplingBatch.from_lists(n, temperature=np.where(np.arange(n) % 4 == 0, 0.0, 1.3), top_p=0.99,
                                 banned_token_ids=[[3, 9]] * n, seeds=range(n))
    out = Sampler()(logits, b)
    assert not np.isin(out, [3, 9]).any()
    masked = base.copy()
    masked[[3, 9]] = -np.inf
    assert (out[::4] == masked.argmax()).all()
    probs = _softmax(masked / 1.3)
    assert len(set(out.tolist())) > 5 and probs[out].min() > 0


# ------------------------------------------------------------ seeded invariance


def _params(kind: int) -> dict:
    return [
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, top_k=20),
        dict(temperature=1.2, min_p=0.1),
        dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
             frequency_penalty=0.3, presence_penalty=0.2),
        dict(temperature=1.5),
    ][kind]


def _row_params(i: int, target_row: int, kind: int) -> dict:
    if i == target_row:
        return _params(kind)
    return dict(temperature=0.0) if i % 3 == 0 else _params(i % 5)


def _run(batch_size: int, target_row: int, kind: int, seed: int, steps: int, vocab: int) -> list[int]:
    """Tokens of the seeded target row over `steps` steps, among greedy and sampled rows of other kinds."""
    logit_rng, other_rng = np.random.default_rng(99), np.random.default_rng(batch_size * 31 + target_row)
    target_logits = [logit_rng.normal(0, 2.5, vocab).astype(np.float32) for _ in range(steps)]
    gens = [np.random.default_rng(1000 + i) for i in range(batch_size)]
    gens[target_row] = np.random.default_rng(seed)
    prompts = [list(other_rng.integers(0, vocab, 7)) for _ in range(batch_size)]
    prompts[target_row] = [1, 2, 3, 5, 8]
    outputs: list[list[int]] = [[] for _ in range(batch_size)]
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    frequency_penalty=0.0, presence_penalty=0.0)
    params = [_row_params(i, target_row, kind) for i in range(batch_size)]
    cols = {name: [p.get(name, d) for p in params] for name, d in defaults.items()}
    sampler = Sampler()
    for step in range(steps):
        logits = other_rng.normal(0, 2, (batch_size, vocab)).astype(np.float32)
        logits[target_row] = target_logits[step]
        b = SamplingBatch.from_lists(batch_size, **cols, prompt_token_ids=prompts,
                                     output_token_ids=[list(o) for o in outputs], generators=gens)
        out = sampler(paddle.to_tensor(logits), b)
        for i in range(batch_size):
            outputs[i].append(int(out[i]))
    return outputs[target_row]


@pytest.mark.parametrize("kind", range(5))
def test_seeded_row_is_independent_of_batch(kind: int) -> None:
    vocab, steps = 2003, 8
    alone = _run(1, 0, kind, seed=42, steps=steps, vocab=vocab)
    assert _run(5, 3, kind, seed=42, steps=steps, vocab=vocab) == alone
    # past the first chunk of rows, among greedy rows (so the sampled rows are not contiguous)
    assert _run(21, 19, kind, seed=42, steps=steps, vocab=vocab) == alone
    assert _run(1, 0, kind, seed=43, steps=steps, vocab=vocab) != alone


# ------------------------------------------------------------ input checks


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.1), ("repetition_penalty", 0.0),
    ("frequency_penalty", float("nan")),
])
def test_bad_parameters_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):  # checked once, when the batch is made
        SamplingBatch.from_lists(2, seeds=[0, 1], **{field: [1 if field == "top_k" else 0.5, value]})


def test_bad_batches_are_rejected() -> None:
    logits = np.zeros((2, 10), np.float32)
    with pytest.raises(ValueError, match="temperature"):
        Sampler()(logits, SamplingBatch.from_lists(3, seeds=[0, 1, 2]))
    with pytest.raises(ValueError, match="banned_token_ids"):
        Sampler()(logits, SamplingBatch.from_lists(2, seeds=[0, 1], banned_token_ids=[[10], []]))
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.from_lists(2, generators=[None, None])
    with pytest.raises(TypeError, match="logits"):
        Sampler()([[0.0, 1.0]], SamplingBatch.from_lists(1, seeds=[0]))
    with pytest.raises(ValueError, match="top_k"):
        SamplingBatch.from_lists(2, top_k=[1, 2, 3])
