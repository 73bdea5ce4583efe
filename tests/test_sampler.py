"""Sampler tests.

References: the fixtures of transformers' tests/generation/test_logits_process.py (transcribed with
their inputs, expected values and tolerances), distributions and repetition penalties computed by
transformers' own warpers (tests/fixtures/reference/sampler_distributions.json, made by
tools/gen_sampler_reference.py), OpenAI's frequency/presence formula, and a plain sort-based
reading of the top-k / top-p / min-p definitions written in this file.
"""
from __future__ import annotations

import json
import math
import pathlib
from collections import Counter
from collections.abc import Sequence

import numpy as np
import paddle
import pytest

from fastdeploy.ops import logits_filters as lp
from fastdeploy.ops.sampling import Sampler
from fastdeploy.ops.sampling_reference import SamplingBatch, draw

REF = json.loads((pathlib.Path(__file__).parent / "fixtures/reference/sampler_distributions.json").read_text())


# transformers-style whole-batch forms of the sampler's steps (new arrays; input untouched)
def apply_repetition_penalty(
    logits: np.ndarray, token_ids: Sequence[Sequence[int]], penalty: float | Sequence[float]
) -> np.ndarray:
    """Repetition penalty over each row's `token_ids` (prompt and output tokens together)."""
    x = lp._as_2d(logits).copy()
    p = lp._per_row(penalty, x.shape[0], np.float32, "penalty")
    if (p <= 0).any():
        raise ValueError("penalty must be > 0")
    rows, toks = lp.token_pairs(token_ids, np.arange(x.shape[0]), x.shape[1], "token_ids")
    lp.repetition_penalty_(x, rows, toks, p)
    return x


def apply_frequency_presence_penalty(
    logits: np.ndarray,
    output_token_ids: Sequence[Sequence[int]],
    frequency_penalty: float | Sequence[float],
    presence_penalty: float | Sequence[float],
) -> np.ndarray:
    x = lp._as_2d(logits).copy()
    b = x.shape[0]
    fp = lp._per_row(frequency_penalty, b, np.float32, "frequency_penalty")
    pp = lp._per_row(presence_penalty, b, np.float32, "presence_penalty")
    rows, toks = lp.token_pairs(output_token_ids, np.arange(b), x.shape[1], "output_token_ids")
    lp.frequency_presence_penalty_(x, rows, toks, fp, pp)
    return x


def apply_temperature(logits: np.ndarray, temperature: float | Sequence[float]) -> np.ndarray:
    x = lp._as_2d(logits)
    t = lp._per_row(temperature, x.shape[0], np.float32, "temperature")
    if not (t > 0).all():
        raise ValueError("temperature must be > 0 here (temperature 0 means greedy and skips sampling)")
    return x / t[:, None]


def _mask_below(x: np.ndarray, tau: np.ndarray, filter_value: float) -> np.ndarray:
    return np.where(x < tau[:, None], np.float32(filter_value), x)


def apply_top_k(logits: np.ndarray, top_k: int | Sequence[int], min_tokens_to_keep: int = 1,
                filter_value: float = -np.inf) -> np.ndarray:
    """Keep the top_k largest logits of each row (and every logit tied with the k-th)."""
    x = lp._as_2d(logits)
    return _mask_below(x, lp.filter_thresholds(x, top_k=top_k, min_tokens_to_keep=min_tokens_to_keep), filter_value)


def apply_top_p(logits: np.ndarray, top_p: float | Sequence[float], min_tokens_to_keep: int = 1,
                filter_value: float = -np.inf) -> np.ndarray:
    """Keep the smallest set of largest-probability tokens whose probability sums to >= top_p."""
    x = lp._as_2d(logits)
    return _mask_below(x, lp.filter_thresholds(x, top_p=top_p, min_tokens_to_keep=min_tokens_to_keep), filter_value)


def apply_min_p(logits: np.ndarray, min_p: float | Sequence[float], min_tokens_to_keep: int = 1,
                filter_value: float = -np.inf) -> np.ndarray:
    """Drop tokens whose probability is below min_p times the row's largest probability."""
    x = lp._as_2d(logits)
    return _mask_below(x, lp.filter_thresholds(x, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep), filter_value)


def _uniform_logits(batch_size: int, length: int) -> np.ndarray:
    return np.ones((batch_size, length), dtype=np.float32) / length


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _assert_almost_equal(a: float, b: float) -> None:
    """unittest's assertAlmostEqual (7 places)."""
    assert round(abs(float(a) - float(b)), 7) == 0, (a, b)


def _assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    """torch.testing.assert_close(rtol=1e-3, atol=1e-3) as the transformers tests use it."""
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------ transformers' logits-processor fixtures


def test_temperature_dist_warper() -> None:
    length = 20
    scores = _uniform_logits(batch_size=2, length=length)
    scores[1, 5] = (1 / length) + 0.1  # peak, 1st batch
    scores[1, 10] = (1 / length) - 0.4  # valley, 1st batch
    probs = _softmax(scores)
    warped_prob_sharp = _softmax(apply_temperature(scores, 0.5))
    warped_prob_smooth = _softmax(apply_temperature(scores, 1.3))
    processed_scores = apply_temperature(scores, 1.3)

    _assert_close(probs[0, :], warped_prob_sharp[0, :])
    _assert_close(probs[0, :], warped_prob_smooth[0, :])
    assert probs[1, :].max() < warped_prob_sharp[1, :].max()
    assert probs[1, :].min() > warped_prob_sharp[1, :].min()
    assert probs[1, :].max() > warped_prob_smooth[1, :].max()
    assert probs[1, :].min() < warped_prob_smooth[1, :].min()
    assert not np.all(scores == processed_scores)


def test_repetition_penalty_dist_process() -> None:
    input_ids = [[0, 1], [5, 0]]
    vocab_size = 10
    scores = _uniform_logits(batch_size=2, length=vocab_size)
    scores[0, 0] = -(1 / vocab_size)
    scores[1, 5] = 4 / vocab_size
    original = scores.copy()

    processed_scores = apply_repetition_penalty(scores, input_ids, 2.0)

    _assert_almost_equal(processed_scores[0, 0], -(1 / vocab_size) * 2)
    _assert_almost_equal(processed_scores[0, 1], (1 / vocab_size) / 2)
    _assert_almost_equal(processed_scores[1, 0], (1 / vocab_size) / 2)
    _assert_almost_equal(processed_scores[1, 5], (4 / vocab_size) / 2)
    assert not np.all(scores == processed_scores)
    np.testing.assert_array_equal(scores, original)


def test_top_k_dist_warper() -> None:
    vocab_size = 10
    batch_size = 2
    ramp_logits = np.tile(np.arange(vocab_size, dtype=np.float32), (batch_size, 1))
    ramp_logits[1:, : vocab_size // 2] = ramp_logits[1:, : vocab_size // 2] + vocab_size

    scores = apply_top_k(ramp_logits, 3)
    assert np.isinf(scores[0]).tolist() == 7 * [True] + 3 * [False]
    assert np.isinf(scores[1]).tolist() == 2 * [True] + 3 * [False] + 5 * [True]
    assert not np.all(scores == ramp_logits)

    length = 5
    logits = _uniform_logits(batch_size=batch_size, length=length)
    scores = apply_top_k(logits, 1, min_tokens_to_keep=3, filter_value=0.0)
    assert (scores == 0.0).sum(axis=-1).tolist() == [0, 0]  # uniform dist is not changed

    ramp_logits = np.tile(np.arange(length, dtype=np.float32), (batch_size, 1))
    scores = apply_top_k(ramp_logits, 1, min_tokens_to_keep=3, filter_value=0.0)
    assert (scores == 0.0).sum(axis=-1).tolist() == [2, 2]  # min_tokens overwrites k


def test_top_p_dist_warper() -> None:
    vocab_size = 10
    batch_size = 2
    dist = np.log(np.array([[0.3, 0.1, 0.1, 0.5], [0.15, 0.3, 0.3, 0.25]], dtype=np.float32))

    filtered_dist = np.exp(apply_top_p(dist, 0.8))
    expected = np.array([[0.3, 0.0, 0.0, 0.5], [0.0, 0.3, 0.3, 0.25]], dtype=np.float32)
    _assert_close(filtered_dist, expected)
    assert not np.all(apply_top_p(dist, 0.8) == dist)

    ramp_logits = np.tile(np.arange(vocab_size, dtype=np.float32), (batch_size, 1)) - (vocab_size // 2)
    ramp_logits[1] = ramp_logits[1] * 100.0
    filtered_dist = apply_top_p(ramp_logits, 0.9, min_tokens_to_keep=2, filter_value=0.0)
    assert (filtered_dist != 0.0).sum(axis=-1).tolist() == [3, 2]


def test_min_p_dist_warper() -> None:
    vocab_size = 10
    batch_size = 2
    dist = np.log(np.array([
        [0.9, 0.0274, 0.047, 0.0274],  # two tokens should be kept (0.047 > 0.9*0.05=0.045)
        [0.15, 0.3, 0.3, 0.25],  # all should be kept -- no high-probability token
        [0.97, 0.01, 0.01, 0.01],  # only the first token should be kept
    ], dtype=np.float32))

    filtered_dist = np.exp(apply_min_p(dist, 0.05))
    expected = np.array([[0.9, 0.0, 0.047, 0.0], [0.15, 0.3, 0.3, 0.25], [0.97, 0.0, 0.0, 0.0]], dtype=np.float32)
    _assert_close(filtered_dist, expected)
    assert not np.all(apply_min_p(dist, 0.05) == dist)

    ramp_logits = np.tile(np.arange(vocab_size, dtype=np.float32) - (vocab_size // 2), (batch_size, 1))
    ramp_logits[1] = ramp_logits[1] * 100.0
    filtered_dist = apply_min_p(ramp_logits, 0.9, min_tokens_to_keep=2, filter_value=0.0)
    assert (filtered_dist != 0.0).sum(axis=-1).tolist() == [2, 2]


# ------------------------------------------------------------ transformers' warpers, chained


@pytest.mark.parametrize("case", REF["filter_cases"], ids=lambda c: c["name"])
def test_filters_match_transformers_distribution(case: dict) -> None:
    logits = np.array([case["logits"]], dtype=np.float32)
    expected = np.array(case["probs"])
    x = apply_temperature(logits, case["temperature"]) if case["temperature"] != 1.0 else logits
    tau = lp.filter_thresholds(x, case["top_k"], case["top_p"], case["min_p"])
    probs = _softmax(np.where(x >= tau[:, None], x, -np.inf))[0]
    np.testing.assert_array_equal(probs > 0, expected > 0)
    np.testing.assert_allclose(probs, expected, atol=1e-6)

    chained = x
    if case["top_k"]:
        chained = apply_top_k(chained, case["top_k"])
    if case["top_p"] < 1:
        chained = apply_top_p(chained, case["top_p"])
    if case["min_p"]:
        chained = apply_min_p(chained, case["min_p"])
    np.testing.assert_allclose(_softmax(chained)[0], expected, atol=1e-6)


@pytest.mark.parametrize("case", REF["repetition_penalty_cases"], ids=lambda c: str(c["penalty"]))
def test_repetition_penalty_matches_transformers(case: dict) -> None:
    logits = np.array([case["logits"]], dtype=np.float32)
    out = apply_repetition_penalty(logits, [case["prompt"] + case["output"]], case["penalty"])
    np.testing.assert_allclose(out[0], case["expected"], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------ OpenAI frequency / presence penalties


def _openai_penalised(logits: np.ndarray, outputs: list[list[int]], fp: list[float], pp: list[float]) -> np.ndarray:
    expected = logits.astype(np.float64).copy()
    for row, out in enumerate(outputs):
        for tok, count in Counter(out).items():
            expected[row, tok] -= count * fp[row] + (count > 0) * pp[row]
    return expected


def test_frequency_presence_penalty_formula() -> None:
    logits = np.array([[1.0, -0.5, 2.0, 0.0, 3.0, -1.0], [0.5, 0.25, -2.0, 1.5, 0.0, 1.0]], dtype=np.float32)
    outputs = [[2, 2, 4, 2], [3, 3, 0]]
    fp, pp = [0.5, -0.25], [0.25, 1.0]
    out = apply_frequency_presence_penalty(logits, outputs, fp, pp)
    # row 0: token 2 -> 2.0 - 3*0.5 - 0.25 = 0.25, token 4 -> 3.0 - 0.5 - 0.25 = 2.25
    np.testing.assert_allclose(out[0], [1.0, -0.5, 0.25, 0.0, 2.25, -1.0], atol=1e-6)
    np.testing.assert_allclose(out, _openai_penalised(logits, outputs, fp, pp), atol=1e-6)


def test_sampler_applies_penalties_before_greedy_argmax() -> None:
    rng = np.random.default_rng(7)
    batch, vocab = 12, 40
    logits = rng.normal(0, 1, (batch, vocab)).astype(np.float32)
    prompts = [list(rng.integers(0, vocab, 6)) for _ in range(batch)]
    outputs = [list(rng.integers(0, 8, 5)) for _ in range(batch)]  # repeats within 8 ids
    banned = [[int(np.argmax(logits[i]))] if i % 3 == 0 else [] for i in range(batch)]
    rep = rng.uniform(0.7, 1.8, batch)
    fp, pp = rng.uniform(-1, 1, batch), rng.uniform(-1, 1, batch)
    b = SamplingBatch.from_lists(batch, temperature=0.0, repetition_penalty=rep, frequency_penalty=fp,
                                 presence_penalty=pp, prompt_token_ids=prompts, output_token_ids=outputs,
                                 banned_token_ids=banned, generators=[None] * batch)
    expected = logits.astype(np.float64).copy()
    for i in range(batch):
        expected[i, banned[i]] = -np.inf
        for tok in set(prompts[i]) | set(outputs[i]):
            v = expected[i, tok]
            expected[i, tok] = v / rep[i] if v > 0 else v * rep[i]
    expected = _openai_penalised(expected, outputs, list(fp), list(pp))
    np.testing.assert_array_equal(Sampler()(paddle.to_tensor(logits), b), expected.argmax(axis=1))


# ------------------------------------------------------------ filters against the plain definition


def _reference_keep(x: np.ndarray, k: int, p: float, mp: float, keep_n: int) -> np.ndarray:
    """Tokens kept by top_k -> top_p -> min_p, read straight from the definitions (full sort)."""
    vocab = x.size
    desc = np.sort(x)[::-1]
    tau = desc[k - 1] if 0 < k < vocab else -np.inf
    if p < 1:
        kept = np.sort(x[x >= tau])[::-1]
        probs = np.exp(kept - kept[0]).astype(np.float64)  # float32 probabilities, summed exactly
        cum = np.cumsum(probs) / probs.sum()
        tau = max(tau, kept[int(np.argmax(cum >= p))])
    if mp > 0:
        tau = max(tau, np.float32(desc[0] + math.log(mp)))
    if keep_n > 1:
        tau = min(tau, desc[keep_n - 1])
    return x >= tau


@pytest.mark.parametrize("keep_n", [1, 3])
def test_filter_thresholds_match_sorted_definition(keep_n: int) -> None:
    rng = np.random.default_rng(11)
    vocab = 30011
    rows = []
    for i in range(24):
        kind = i % 5
        if kind == 0:
            x = rng.normal(0, 3, vocab)  # flat
        elif kind == 1:
            x = rng.normal(0, 2, vocab)
            x[rng.choice(vocab, 30, replace=False)] += rng.uniform(4, 14, 30)  # peaked, LLM-like
        elif kind == 2:
            x = np.round(rng.normal(0, 2, vocab) * 4) / 4  # many ties
        elif kind == 3:
            x = (np.arange(vocab) - vocab / 2) * 0.01 * rng.uniform(1, 100)  # ramp, some extreme
        else:
            x = rng.normal(0, 1, vocab)
            x[rng.choice(vocab, 100, replace=False)] = -np.inf  # banned tokens
        rows.append(x)
    x = np.array(rows, dtype=np.float32)
    k = rng.choice([0, -1, 1, 2, 5, 50, 3000, vocab - 1, vocab + 5], 24)
    p = rng.choice([1.0, 0.0, 0.3, 0.8, 0.95, 0.999, 0.9999], 24)
    mp = rng.choice([0.0, 0.0, 0.01, 0.2, 1.0], 24)
    tau = lp.filter_thresholds(x, k, p, mp, min_tokens_to_keep=keep_n)
    for i in range(24):
        expected = _reference_keep(x[i], int(k[i]), float(p[i]), float(mp[i]), keep_n)
        np.testing.assert_array_equal(x[i] >= tau[i], expected, err_msg=f"row {i}: k={k[i]} p={p[i]} min_p={mp[i]}")


def test_filter_thresholds_match_sorted_definition_small_vocabularies() -> None:
    for seed in range(150):
        rng = np.random.default_rng(seed)
        vocab, batch = int(rng.choice([1, 2, 3, 7, 50, 1000])), int(rng.integers(1, 10))
        x = rng.normal(0, 1, (batch, vocab)) * rng.choice([0.01, 1, 30, 300])
        if seed % 3 == 0:
            x = np.round(x * 2) / 2  # ties
        if seed % 4 == 1:
            x[rng.random((batch, vocab)) < 0.2] = -np.inf
            x[:, 0] = 0.0
        x = x.astype(np.float32)
        k = rng.choice([0, -1, 1, 2, 3, 10, vocab - 1, vocab, vocab + 1], batch)
        p = rng.choice([1.0, 0.0, 0.1, 0.5, 0.9, 0.99, 0.99999], batch)
        mp = rng.choice([0.0, 0.0, 0.05, 0.5, 1.0], batch)
        keep_n = int(rng.choice([1, 1, 2, 5]))
        tau = lp.filter_thresholds(x, k, p, mp, min_tokens_to_keep=keep_n)
        for i in range(batch):
            expected = np.ones(vocab, bool) if keep_n >= vocab else _reference_keep(
                x[i], int(k[i]), float(p[i]), float(mp[i]), keep_n)
            np.testing.assert_array_equal(x[i] >= tau[i], expected, err_msg=f"seed {seed} row {i}")


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
