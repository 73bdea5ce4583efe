"""The compiled sampling op (fastdeploy.sampling.sampler.sample, custom_ops/kern_sampling.inc) against the numpy
sampler it reimplements (fastdeploy.sampling.sampler.sample_reference, which runs
fastdeploy.sampling.reference.sample_numpy).

Both return each row's token and, for sampled rows, the filter threshold tau (the row kept the tokens
with logit / temperature >= tau). Greedy rows must agree exactly. For sampled rows the kept-token set
(x >= tau) and the token drawn with the same uniform must agree, with one allowed exception, checked
precisely below. The op computes e = exp(x - max) with its own SIMD polynomial (within 1.01 ulp of
exact), numpy's float32 exp is within 2.52 ulp, and the two differ by at most 3 ulp, i.e. less than
4e-7 relative (measured over 14M arguments); both then sum in float64, in different orders. Any
cumulative mass therefore differs by less than 1e-6 of the total, so
  * a top-p cut may differ only where the reference's cumulative mass (float64, descending logits) lies
    within 1e-6 * total of p * total;
  * a drawn token may differ only where u * total lies within 1e-6 * total of the edge of the op's
    token's CDF interval, as the reference computes that CDF (token order, float64).
Such differences must also stay rare (at most 1% of the sampled rows of a test); in practice there are
none: 0 of 2,644 sampled rows of random batches per instruction set when this was written.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import paddle
import pytest

from fastdeploy import ops
from fastdeploy.ops import build
from fastdeploy.sampling import sampler as sampling_mod
from fastdeploy.sampling.policy import pack_token_ids
from fastdeploy.sampling.sampler import Sampler
from fastdeploy.step_types import SamplingBatch

LIB = build.library()
ISAS = [name for name in ("avx512", "avx2") if LIB is not None and build.set_isa(name) == name]
if LIB is not None:
    build.set_isa("best")

TOLERANCE = 1e-6  # of the total mass; see the module docstring


def test_library_has_the_op():
    assert LIB is not None and "fd_sample" in LIB.ops


@pytest.fixture(params=ISAS)
def isa(request):
    assert ops.set_isa(request.param) == request.param
    yield request.param
    ops.set_isa("best")


# ---------------------------------------------------------------- random batches


def random_logits(rng: np.random.Generator, vocab: int, style: str) -> np.ndarray:
    if style == "flat":
        x = rng.normal(0, rng.choice([0.5, 2.0, 8.0]), vocab)
    elif style == "peaked":  # LLM-like: a few tokens far above the rest
        x = rng.normal(0, 1.5, vocab)
        hot = rng.choice(vocab, min(vocab, 30), replace=False)
        x[hot] += rng.uniform(4, 12, hot.size)
    elif style == "ties":  # few distinct values: ties at every cut
        x = np.round(rng.normal(0, 2, vocab) * 2) / 2
    elif style == "masked":  # some -inf, one finite token at least
        x = rng.normal(0, 1, vocab)
        x[rng.random(vocab) < 0.3] = -np.inf
        x[rng.integers(vocab)] = 0.5
    else:  # extreme scale: most of e underflows to 0
        x = rng.normal(0, 1, vocab) * 300
    return x.astype(np.float32)


def random_batch(rng: np.random.Generator, rows: int, vocab: int) -> tuple[np.ndarray, SamplingBatch, np.ndarray]:
    """Logits, a batch of mixed rows (greedy by each of the three rules, every filter alone and combined,
    penalties, bans, all-but-one banned) and the uniforms."""
    logits = np.stack([random_logits(rng, vocab, rng.choice(["flat", "peaked", "ties", "masked", "extreme"]))
                       for _ in range(rows)])

    def pick(options: list, p: list | None = None) -> np.ndarray:
        return rng.choice(options, rows, p=p)

    temperature = pick([0.0, 0.3, 0.8, 1.0, 1.7], [0.15, 0.2, 0.25, 0.25, 0.15])
    top_k = pick([0, -1, 1, 2, 5, 50, vocab - 1, vocab, vocab + 3])
    top_p = pick([1.0, 1.0, 0.0, 0.3, 0.9, 0.95, 0.999])
    min_p = pick([0.0, 0.0, 0.01, 0.2])
    rep = np.where(rng.random(rows) < 0.4, pick([0.8, 1.3, 2.0]), 1.0)
    freq = np.where(rng.random(rows) < 0.4, pick([0.5, -0.2]), 0.0)
    pres = np.where(rng.random(rows) < 0.4, pick([0.3, -0.1]), 0.0)
    prompts = [list(rng.integers(0, vocab, rng.integers(0, 40))) for _ in range(rows)]
    outputs = [list(rng.integers(0, min(vocab, 20), rng.integers(0, 30))) for _ in range(rows)]  # repeats
    # Bans never take a row's largest logit, so every row keeps a finite one.
    best = logits.argmax(axis=1)
    banned = [[t for t in rng.integers(0, vocab, rng.integers(1, 5)) if t != best[r]] if rng.random() < 0.3 else []
              for r in range(rows)]
    if rows > 1 and vocab > 1:  # all but one token banned
        banned[1] = [t for t in range(vocab) if t != best[1]]
        temperature[1] = 0.9
    batch = SamplingBatch.from_lists(rows, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                     repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                                     prompt_token_ids=prompts, output_token_ids=outputs, banned_token_ids=banned,
                                     uniforms=[0.0] * rows)
    uniforms = rng.random(rows)
    uniforms[: min(rows, 2)] = [0.0, np.nextafter(1.0, 0.0)][: min(rows, 2)]
    return logits, batch, uniforms


def op_args(batch: SamplingBatch, uniforms: np.ndarray, vocab: int) -> dict:
    ids, offsets = pack_token_ids(batch, vocab)
    return dict(greedy=batch.greedy_mask(), uniforms=uniforms, temperature=batch.temperature, top_k=batch.top_k,
                top_p=batch.top_p, min_p=batch.min_p, repetition_penalty=batch.repetition_penalty,
                frequency_penalty=batch.frequency_penalty, presence_penalty=batch.presence_penalty,
                token_ids=ids, token_offsets=offsets)


def scaled_logits(logits: np.ndarray, batch: SamplingBatch, r: int, scale: bool = True) -> np.ndarray:
    """Row r after bans, penalties and (if `scale`) temperature, written out from the definitions
    (float32 steps rounded as the numpy sampler rounds them)."""
    x = logits[r].copy()
    x[list(batch.banned_token_ids[r])] = -np.inf
    p = np.float32(batch.repetition_penalty[r])
    if p != 1:
        for t in set(batch.prompt_token_ids[r]) | set(batch.output_token_ids[r]):
            x[t] = x[t] / p if x[t] > 0 else x[t] * p
    f, pres = float(batch.frequency_penalty[r]), float(batch.presence_penalty[r])
    if f != 0 or pres != 0:
        for t, count in Counter(batch.output_token_ids[r]).items():
            x[t] -= np.float32(count * f + pres)
    return x / batch.temperature[r] if scale else x


def cut_is_ambiguous(x: np.ndarray, batch: SamplingBatch, r: int, tau: float) -> bool:
    """Whether `tau` is the threshold the reference would pick for row r if its top-p cumulative masses
    moved by up to TOLERANCE of the total (see the module docstring)."""
    k, p, mp = int(batch.top_k[r]), float(batch.top_p[r]), float(batch.min_p[r])
    if p >= 1:
        return False
    vocab = x.size
    tau_k = np.sort(x)[::-1][k - 1] if 0 < k < vocab else -np.inf
    kept = np.sort(x[x >= tau_k])[::-1]
    w = np.exp(kept - x.max()).astype(np.float64)  # the reference's float32 e, summed in float64
    cum, z = np.cumsum(w), w.sum()
    lo, hi = p * z - TOLERANCE * z, p * z + TOLERANCE * z
    before = np.concatenate([[-np.inf], cum[:-1]])
    cuts = kept[(cum >= lo) & (before < hi)]
    floor = np.float32(x.max() + np.log(mp)) if mp > 0 else -np.inf
    return any(np.float32(max(tau_k, c, floor)) == np.float32(tau) for c in cuts)


def draw_is_ambiguous(x: np.ndarray, tau: float, u: float, token: int) -> bool:
    """Whether `token` is within TOLERANCE of the total of being the reference's draw (module docstring)."""
    w = np.where(x >= tau, np.exp(x - x.max()), 0.0).astype(np.float64)
    cum = np.cumsum(w)
    total = cum[-1]
    t, slack = u * total, TOLERANCE * total
    start = cum[token - 1] if token > 0 else 0.0
    return w[token] > 0 and start - slack <= t <= cum[token] + slack


def assert_matches_reference(logits: np.ndarray, batch: SamplingBatch, uniforms: np.ndarray) -> int:
    """Compiled op vs reference on one batch; returns the number of sampled rows compared."""
    vocab = logits.shape[1]
    args = op_args(batch, uniforms, vocab)
    tokens, tau = sampling_mod.sample(paddle.to_tensor(logits), return_thresholds=True, **args)
    ref_tokens, ref_tau = sampling_mod.sample_reference(logits, return_thresholds=True, **args)
    greedy = args["greedy"]
    np.testing.assert_array_equal(tokens[greedy], ref_tokens[greedy])
    assert np.isnan(tau[greedy]).all() and np.isnan(ref_tau[greedy]).all()
    explained = []
    for r in np.flatnonzero(~greedy):
        x = scaled_logits(logits, batch, r)
        kept, ref_kept = x >= tau[r], x >= ref_tau[r]
        assert ref_kept[ref_tokens[r]] and kept[tokens[r]], f"row {r} drew a filtered-out token"
        if not np.array_equal(kept, ref_kept):
            assert cut_is_ambiguous(x, batch, r, tau[r]), f"row {r}: kept {kept.sum()} tokens, reference {ref_kept.sum()}"
            explained.append(r)
        elif tokens[r] != ref_tokens[r]:
            assert draw_is_ambiguous(x, ref_tau[r], uniforms[r], tokens[r]), f"row {r}: {tokens[r]} != {ref_tokens[r]}"
            explained.append(r)
    sampled = int((~greedy).sum())
    assert len(explained) <= max(1, sampled // 100), f"rounding decided too many rows: {explained}"
    return sampled


@pytest.mark.parametrize("vocab, rows, seeds", [(1, 9, 3), (7, 40, 4), (1000, 64, 4), (103424, 12, 1)])
def test_matches_reference_on_random_batches(isa, vocab, rows, seeds):
    sampled = 0
    for seed in range(seeds):
        rng = np.random.default_rng(1000 * vocab + seed)
        sampled += assert_matches_reference(*random_batch(rng, rows, vocab))
    assert sampled >= rows * seeds // 3  # about a third of the rows are greedy


@pytest.mark.parametrize("vocab", [1000, 103424])
@pytest.mark.parametrize("filters", [
    dict(), dict(top_k=1), dict(top_k=50), dict(top_k=999), dict(top_p=0.9), dict(top_p=0.999),
    dict(min_p=0.05), dict(top_k=50, top_p=0.8), dict(top_p=0.9, min_p=0.1), dict(top_k=20, top_p=0.7, min_p=0.02),
], ids=lambda f: "+".join(f"{k}={v}" for k, v in f.items()) or "none")
def test_each_filter_alone_and_combined(vocab, filters):
    rng = np.random.default_rng(vocab + len(filters))
    rows = 8
    logits = np.stack([random_logits(rng, vocab, style) for style in ("flat", "peaked", "ties", "masked") * 2])
    batch = SamplingBatch.from_lists(rows, temperature=[0.7, 1.0] * 4, uniforms=[0.0] * rows, **filters)
    assert_matches_reference(logits, batch, rng.random(rows))


def test_ties_at_the_cut_are_kept():
    x = np.array([[5, 4, 4, 4, 3, 2, 4, 1]] * 2, dtype=np.float32)
    batch = SamplingBatch.from_lists(2, top_k=[2, 6], uniforms=[0.0] * 2)
    args = op_args(batch, np.array([0.5, 0.5]), 8)
    _, tau = sampling_mod.sample(x, return_thresholds=True, **args)
    np.testing.assert_array_equal(tau, [4, 3])  # 2nd largest: 4, all four 4s stay; 6th: 3
    assert_matches_reference(x, batch, np.linspace(0, 0.999, 2))
    # every kept token is reachable, in token order: sweep the uniforms over one row
    u = np.linspace(0, 1, 64, endpoint=False)
    sweep = SamplingBatch.from_lists(64, top_k=2, uniforms=[0.0] * 64)
    tokens = sampling_mod.sample(np.repeat(x[:1], 64, axis=0), **op_args(sweep, u, 8))
    assert set(tokens.tolist()) == {0, 1, 2, 3, 6} and (np.diff(tokens) >= 0).all()


def test_all_but_one_banned_and_vocab_of_one():
    vocab = 5000
    logits = np.random.default_rng(0).normal(0, 1, (3, vocab)).astype(np.float32)
    banned = [[t for t in range(vocab) if t != 1234]] * 3
    batch = SamplingBatch.from_lists(3, temperature=[0.0, 0.7, 1.5], top_p=[1.0, 0.5, 1.0], top_k=[0, 0, 10],
                                     banned_token_ids=banned, uniforms=[0.0] * 3)
    np.testing.assert_array_equal(sampling_mod.sample(logits, **op_args(batch, np.array([0.0, 0.3, 0.999]), vocab)), 1234)
    one = SamplingBatch.from_lists(2, temperature=[0.0, 1.0], top_p=0.5, uniforms=[0.0] * 2)
    np.testing.assert_array_equal(sampling_mod.sample(np.ones((2, 1), np.float32), **op_args(one, np.array([0, 0.9]), 1)), 0)


def test_penalties_match_their_definitions():
    rng = np.random.default_rng(3)
    rows, vocab = 16, 300
    logits = rng.normal(0, 1, (rows, vocab)).astype(np.float32)
    prompts = [list(rng.integers(0, vocab, 50)) for _ in range(rows)]
    outputs = [list(rng.integers(0, 12, 20)) for _ in range(rows)]
    batch = SamplingBatch.from_lists(rows, temperature=0.0, repetition_penalty=rng.uniform(0.5, 2, rows),
                                     frequency_penalty=rng.uniform(-1, 1, rows), presence_penalty=rng.uniform(-1, 1, rows),
                                     prompt_token_ids=prompts, output_token_ids=outputs,
                                     banned_token_ids=[[int(np.argmax(logits[r]))] for r in range(rows)],
                                     uniforms=[0.0] * rows)
    expected = [int(np.argmax(scaled_logits(logits, batch, r, scale=False))) for r in range(rows)]
    np.testing.assert_array_equal(sampling_mod.sample(logits, **op_args(batch, np.zeros(rows), vocab)), expected)


def test_rows_without_a_finite_maximum():
    logits = np.zeros((4, 50), np.float32)
    logits[1] = -np.inf
    logits[2, 7] = np.nan
    logits[3, 9] = np.inf
    for bad in (1, 2, 3):
        temperature = np.zeros(4)
        temperature[bad] = 1.0
        batch = SamplingBatch.from_lists(4, temperature=temperature, uniforms=[0.0] * 4)
        with pytest.raises(ValueError, match=f"logits of row {bad} are all -inf or hold NaN/inf"):
            sampling_mod.sample(logits, **op_args(batch, np.full(4, 0.5), 50))
    # greedy rows take numpy's argmax: the first NaN, the first +inf, index 0 of an all -inf row
    greedy = SamplingBatch.from_lists(4, temperature=0.0, uniforms=[0.0] * 4)
    np.testing.assert_array_equal(sampling_mod.sample(logits, **op_args(greedy, np.zeros(4), 50)), logits.argmax(axis=1))


def test_rows_do_not_depend_on_batch_threads_or_isa():
    rng = np.random.default_rng(21)
    logits, batch, uniforms = random_batch(rng, 24, 4099)
    args = op_args(batch, uniforms, 4099)
    results = []
    for isa_name in ISAS:
        ops.set_isa(isa_name)
        for threads in (1, 2):
            ops.set_num_threads(threads)
            results.append(sampling_mod.sample(logits, return_thresholds=True, **args))
    ops.set_isa("best")
    ops.set_num_threads(0)
    for tokens, tau in results[1:]:
        np.testing.assert_array_equal(tokens, results[0][0])
        np.testing.assert_array_equal(tau, results[0][1])
    for r in (0, 5, 23):  # each row alone
        alone = SamplingBatch(**{f: getattr(batch, f)[r:r + 1] for f in SamplingBatch.__slots__
                                 if getattr(batch, f) is not None})
        tokens, tau = sampling_mod.sample(logits[r:r + 1], return_thresholds=True, **op_args(alone, uniforms[r:r + 1], 4099))
        assert tokens[0] == results[0][0][r] and np.array_equal(tau, results[0][1][r:r + 1], equal_nan=True)


def test_logits_are_left_unchanged():
    rng = np.random.default_rng(8)
    logits, batch, uniforms = random_batch(rng, 16, 257)
    tensor, array = paddle.to_tensor(logits), logits.copy()
    args = op_args(batch, uniforms, 257)
    sampling_mod.sample(tensor, **args)
    sampling_mod.sample(array, **args)
    np.testing.assert_array_equal(tensor.numpy(), logits)
    np.testing.assert_array_equal(array, logits)


def test_wrapper_rejects_bad_arguments():
    batch = SamplingBatch.from_lists(2, banned_token_ids=[[1], [2, 3]], uniforms=[0.0] * 2)
    args = op_args(batch, np.array([0.1, 0.2]), 10)
    logits = np.zeros((2, 10), np.float32)
    with pytest.raises(TypeError, match="float32"):
        sampling_mod.sample(logits.astype(np.float64), **args)
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        sampling_mod.sample(np.zeros(10, np.float32), **args)
    with pytest.raises(ValueError, match="top_p"):
        sampling_mod.sample(logits, **{**args, "top_p": np.ones(3)})
    with pytest.raises(ValueError, match="token_offsets"):
        sampling_mod.sample(logits, **{**args, "token_offsets": args["token_offsets"][:-1]})
    with pytest.raises(ValueError, match="token_ids"):
        sampling_mod.sample(logits, **{**args, "token_ids": np.array([1, 2, 10])})
    with pytest.raises(ValueError, match="uniforms"):
        sampling_mod.sample(logits, **{**args, "uniforms": np.array([0.5, 1.0])})
    with pytest.raises(ValueError, match="temperature"):  # only greedy rows may have temperature 0
        sampling_mod.sample(logits, **{**args, "temperature": np.array([1.0, 0.0])})
    with pytest.raises(ValueError, match="banned_token_ids"):
        pack_token_ids(SamplingBatch.from_lists(1, banned_token_ids=[[10]], uniforms=[0.0]), 10)


def test_falls_back_to_the_reference_without_the_library(monkeypatch):
    rng = np.random.default_rng(4)
    logits, batch, uniforms = random_batch(rng, 20, 300)
    args = op_args(batch, uniforms, 300)
    expected = sampling_mod.sample_reference(logits, return_thresholds=True, **args)
    monkeypatch.setattr(build, "_tried", True)
    monkeypatch.setattr(build, "_library", None)
    fallback = sampling_mod.sample(logits, return_thresholds=True, **args)
    np.testing.assert_array_equal(fallback[0], expected[0])
    np.testing.assert_array_equal(fallback[1], expected[1])


def test_sampler_runs_the_compiled_op_by_default_and_both_paths_agree(monkeypatch):
    calls = []
    compiled = sampling_mod._run
    monkeypatch.setattr(sampling_mod, "_run", lambda *a, **k: calls.append(1) or compiled(*a, **k))
    rng = np.random.default_rng(5)
    logits, batch, _ = random_batch(rng, 32, 2003)
    batch.uniforms = np.random.default_rng(100).random(32)

    def run(use_compiled: bool) -> np.ndarray:
        return Sampler(use_compiled)(paddle.to_tensor(logits), batch)

    fast = run(True)
    assert calls == [1]
    np.testing.assert_array_equal(fast, run(False))
    assert calls == [1]
    assert Sampler().use_compiled


def test_plain_greedy_batches_skip_the_op_with_the_same_tokens(monkeypatch):
    """All rows greedy without bans or penalties: numpy's argmax instead of the op, same tokens (first
    maximum on ties, first NaN), and the op again as soon as one row bans or penalises."""
    calls = []
    compiled = sampling_mod._run
    monkeypatch.setattr(sampling_mod, "_run", lambda *a, **k: calls.append(1) or compiled(*a, **k))
    rng = np.random.default_rng(9)
    logits = np.round(rng.normal(size=(6, 1001)), 1).astype(np.float32)  # many ties
    logits[3, [17, 400]] = np.nan
    logits[4] = -np.inf
    batch = SamplingBatch.from_lists(6, temperature=0.0)
    batch.prompt_token_ids = [[5, 6]] * 6
    batch.output_token_ids = [[7]] * 6
    fast = Sampler()(paddle.to_tensor(logits), batch)
    assert calls == []
    expected = sampling_mod.sample(paddle.to_tensor(logits), greedy=np.ones(6, bool), uniforms=np.zeros(6),
                          temperature=np.zeros(6, np.float32), top_k=np.zeros(6, np.int64),
                          top_p=np.ones(6, np.float32), min_p=np.zeros(6, np.float32),
                          repetition_penalty=np.ones(6, np.float32), frequency_penalty=np.zeros(6, np.float32),
                          presence_penalty=np.zeros(6, np.float32), token_ids=np.zeros(0, np.int64),
                          token_offsets=np.zeros(19, np.int64))
    np.testing.assert_array_equal(fast, expected)
    assert fast[3] == 17 and fast[4] == 0
    calls.clear()
    batch.repetition_penalty = np.full(6, 1.2, np.float32)
    Sampler()(paddle.to_tensor(logits), batch)
    assert calls == [1]
    batch.repetition_penalty = np.ones(6, np.float32)
    batch.banned_token_ids = [[]] * 5 + [[3]]
    Sampler()(paddle.to_tensor(logits), batch)
    assert calls == [1, 1]


def test_pack_token_ids_takes_lists_or_arrays():
    lists = dict(banned_token_ids=[[3], []], prompt_token_ids=[[1, 2, 2], [4]], output_token_ids=[[5], [6, 6]])
    kwargs = dict(repetition_penalty=[1.2, 1.0], frequency_penalty=[0.0, 0.5], uniforms=[0.0] * 2)
    ids, offsets = pack_token_ids(SamplingBatch.from_lists(2, **lists, **kwargs), 10)
    np.testing.assert_array_equal(ids, [3, 1, 2, 2, 5, 6, 6])  # row 1 has no repetition penalty: no prompt
    np.testing.assert_array_equal(offsets, [0, 1, 4, 5, 5, 5, 7])
    arrays = {name: [np.array(t, dtype=np.int32) for t in seqs] for name, seqs in lists.items()}
    same = pack_token_ids(SamplingBatch.from_lists(2, **arrays, **kwargs), 10)
    np.testing.assert_array_equal(same[0], ids)
    np.testing.assert_array_equal(same[1], offsets)
