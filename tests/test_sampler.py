"""Sampler tests: the filters and penalties (draws, seeded rows and input checks: test_sampler_draws.py).

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

from fastdeploy.sampling.sampler import Sampler
from fastdeploy.sampling import filters as lp
from fastdeploy.step_types import SamplingBatch

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
