"""The compiled CPU ops (custom_ops/) against their pure-Paddle references in fastdeploy.ops.

The first test run compiles the library (~20 s, cached in ~/.cache/fastdeploy/ops). Every comparison
runs for each instruction set this CPU has (AVX-512 and its AVX2 fallback). Beyond agreeing with the
references, the kernels promise that a row's result does not depend on the rest of the batch, the
thread count or the instruction set: those are asserted bit for bit.
"""
from __future__ import annotations

import functools
import logging

import numpy as np
import paddle
import pytest

from fastdeploy import ops
from fastdeploy.ops import build
from fastdeploy.ops.kv_cache import quantize_fp8_rows

LIB = build.library()
ISAS = [name for name in ("avx512_bf16", "avx512", "avx2") if LIB is not None and build.set_isa(name) == name]
if LIB is not None:
    build.set_isa("best")


def test_library_builds_and_runs_here():
    assert LIB is not None, "the compiled ops failed to build or load (see the logged warning)"
    info = ops.runtime_info()
    assert info["compiled"] and info["active_isa"] in ("avx2", "avx512", "avx512_bf16") and info["num_threads"] >= 1
    assert "avx2" in ISAS


@pytest.fixture(params=ISAS)
def isa(request):
    assert ops.set_isa(request.param) == request.param
    yield request.param
    ops.set_isa("best")


def tensor(a: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.ascontiguousarray(a))


def assert_close(actual: paddle.Tensor, expected: paddle.Tensor | np.ndarray, rel: float) -> None:
    a = actual.numpy() if isinstance(actual, paddle.Tensor) else actual
    e = expected.numpy() if isinstance(expected, paddle.Tensor) else expected
    assert a.shape == e.shape
    scale = max(float(np.abs(e).max()), 1e-6)
    assert float(np.abs(a - e).max()) <= rel * scale, float(np.abs(a - e).max()) / scale


# ---------------------------------------------------------------- attention

def make_batch(rng, heads, kv_heads, head_dim, block_size, query_lens, context_lens, index_dtype="int64"):
    """A ragged step over a shared, shuffled block pool whose cache already holds every context."""
    blocks = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks) + 3
    order = rng.permutation(num_blocks)
    tables = np.zeros((len(blocks), max(blocks) + 1), dtype=np.int64)
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[used:used + n]
        used += n
    slots = [tables[b, p // block_size] * block_size + p % block_size
             for b, (q, c) in enumerate(zip(query_lens, context_lens)) for p in range(c - q, c)]
    t = sum(query_lens)
    return dict(
        q=rng.standard_normal((t, heads, head_dim), dtype=np.float32),
        k=rng.standard_normal((t, kv_heads, head_dim), dtype=np.float32),
        v=rng.standard_normal((t, kv_heads, head_dim), dtype=np.float32),
        cache=rng.standard_normal((2, num_blocks, kv_heads, block_size, head_dim), dtype=np.float32),
        meta=[np.array(slots, dtype=index_dtype), np.concatenate([[0], np.cumsum(query_lens)]).astype(index_dtype),
              np.array(context_lens, dtype=index_dtype), tables.astype(index_dtype)],
        block_size=block_size, scale=head_dim ** -0.5)


def make_cache(values: np.ndarray, cache_dtype: str) -> paddle.Tensor:
    """values [2, blocks, KVH, block_size, D] as a cache of `cache_dtype` (block_wise_fp8: its rows quantized)."""
    if cache_dtype == "block_wise_fp8":
        return tensor(quantize_fp8_rows(values.reshape(-1, values.shape[-1])).reshape(*values.shape[:-1], -1))
    return tensor(values).astype(cache_dtype)


def cache_bits(cache: paddle.Tensor) -> np.ndarray:
    return cache.numpy() if cache.dtype == paddle.uint8 else cache.astype("float32").numpy()


def run_attention(batch, fn=ops.paged_attention, cache_dtype="float32"):
    cache = make_cache(batch["cache"], cache_dtype)
    out = fn(tensor(batch["q"]), tensor(batch["k"]), tensor(batch["v"]), cache, *map(tensor, batch["meta"]),
             batch["block_size"], batch["scale"])
    return out, cache


ATTENTION_CASES = [
    # heads, kv_heads, head_dim, block_size, query_lens, context_lens
    (16, 2, 128, 64, [1, 1, 1, 1], [1, 64, 65, 300]),  # decode, GQA 8, contexts on and across block edges
    (8, 2, 64, 16, [1, 7, 33, 16], [100, 7, 70, 16]),  # mixed decode / chunked prefill / full prefill, GQA 4
    (4, 4, 64, 16, [20, 1, 3], [20, 17, 48]),  # MHA (GQA 1)
    (8, 1, 128, 16, [130], [200]),  # a prefill chunk longer than one work tile, with cached prefix
    (8, 2, 64, 64, [0, 5, 0, 2], [9, 5, 30, 2]),  # requests with no new tokens in the step
    (4, 2, 16, 16, [1, 9], [33, 9]),  # the tiny test checkpoints' head_dim
    (8, 2, 48, 16, [1, 20], [40, 20]),  # head_dim no multiple of 32: no bf16 pair dot products
    (8, 2, 64, 24, [1, 30, 5], [50, 30, 77]),  # a block size that is no multiple of 16: chunks span blocks
    (16, 2, 128, 64, [1], [2600]),  # one long decode: its kv heads shared out to the threads
    (16, 1, 128, 64, [1], [2600]),  # one kv head (fewer than threads): its 512-position spans shared out
    (16, 2, 128, 64, [1, 24], [2600, 1040]),  # long contexts in a batch, a prefill chunk across a span edge
    # head_dims that are no multiple of 16: the register blocks work on zero-padded rows
    (4, 2, 8, 16, [3, 1], [3, 18]),
    (4, 4, 4, 16, [5, 1], [21, 40]),
    (4, 2, 20, 16, [1, 12], [40, 12]),
    (6, 3, 40, 24, [1, 30, 2], [50, 30, 77]),  # and a block size that is no multiple of 16
    (8, 1, 72, 16, [1, 20], [33, 20]),  # GQA 8: wide register blocks
    (14, 2, 264, 16, [1, 17], [45, 17]),
    (16, 1, 40, 64, [1], [2600]),  # one kv head: spans shared out and folded
    (16, 2, 104, 64, [1, 24], [2600, 1040]),
]


CACHE_DTYPES = ["float32", "bfloat16", "block_wise_fp8"]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_paged_attention_matches_reference(isa, case, cache_dtype):
    """A bf16 cache holds the new K/V rounded to nearest even, as Paddle's cast rounds them; an fp8 one
    each row scaled to 448 at most and cast to float8_e4m3fn as Paddle casts, then its scale."""
    rng = np.random.default_rng(len(case[4]) * 7 + case[2])
    batch = make_batch(rng, *case, index_dtype="int32" if case[3] == 16 else "int64")
    out, cache = run_attention(batch, cache_dtype=cache_dtype)
    ref, ref_cache = run_attention(batch, ops.paged_attention_reference, cache_dtype)
    assert out.shape == [sum(case[4]), case[0] * case[2]]
    assert_close(out, ref, 1e-5)
    # the same K/V written to the same slots, where FastDeploy's [2, blocks, KVH, block_size, D] puts them
    np.testing.assert_array_equal(cache_bits(cache), cache_bits(ref_cache))
    written = np.stack([cache_bits(cache)[:, s // case[3], :, s % case[3]] for s in batch["meta"][0]], 1)
    expected = cache_bits(make_cache(np.stack([batch["k"], batch["v"]]), cache_dtype))
    np.testing.assert_array_equal(written, expected)


def test_fp8_cache_rounds_every_value_as_paddle_casts(isa):
    """Rows whose largest |value| is 448 are cast as they are: every float8 e4m3fn value, every midpoint
    between neighbours (ties to even), values just above them, subnormals and what rounds to zero, both signs."""
    codes = np.arange(0x7F, dtype=np.uint8)  # 0 .. 448 (0x7F is NaN)
    values = tensor(codes).view("float8_e4m3fn").astype("float32").numpy()
    mids = (values[:-1] + values[1:]) / 2
    pool = np.concatenate([values, mids, mids + 1e-3 * np.diff(values), [1e-7, 2.0 ** -10]])
    pool = np.concatenate([pool, -pool]).astype(np.float32)
    rows = np.resize(pool, (-(-pool.size // 63), 63))
    rows = np.concatenate([np.full((len(rows), 1), 448.0, np.float32), rows], axis=1)  # [n, 64]
    n = len(rows)
    k = rows.reshape(n, 1, 64)
    batch = dict(q=np.ones((n, 1, 64), np.float32), k=k, v=k.copy(), cache=np.zeros((2, n, 1, 1, 64), np.float32),
                 meta=[np.arange(n), np.arange(n + 1), np.ones(n, np.int64), np.arange(n).reshape(n, 1)],
                 block_size=1, scale=0.125)
    _, cache = run_attention(batch, cache_dtype="block_wise_fp8")
    got = cache.numpy()[0].reshape(n, 68)
    want = np.concatenate([tensor(rows).astype("float8_e4m3fn").view("uint8").numpy(),
                           np.ones((n, 1), "<f4").view(np.uint8)], axis=1)
    np.testing.assert_array_equal(got, want)


def test_paged_attention_skips_negative_slots():
    rng = np.random.default_rng(3)
    batch = make_batch(rng, 4, 2, 64, 16, [2, 1], [2, 20])
    batch["meta"][0][1] = -1  # padding token: its K/V must not be written anywhere
    out, cache = run_attention(batch)
    ref, ref_cache = run_attention(batch, ops.paged_attention_reference)
    np.testing.assert_array_equal(cache.numpy(), ref_cache.numpy())
    assert_close(out, ref, 1e-5)


def assert_batch_invariant(batch, run) -> np.ndarray:
    """Each request alone, and the whole batch on one thread, give the batch's bits; returns its output."""
    together = run(batch)[0].numpy()
    starts = batch["meta"][1]
    for b in range(len(starts) - 1):
        lo, hi = int(starts[b]), int(starts[b + 1])
        alone = dict(batch, q=batch["q"][lo:hi], k=batch["k"][lo:hi], v=batch["v"][lo:hi],
                     meta=[batch["meta"][0][lo:hi], np.array([0, hi - lo]), batch["meta"][2][b:b + 1],
                           batch["meta"][3][b:b + 1]])
        np.testing.assert_array_equal(run(alone)[0].numpy(), together[lo:hi])
    ops.set_num_threads(1)
    try:
        np.testing.assert_array_equal(run(batch)[0].numpy(), together)
    finally:
        ops.set_num_threads(0)
    return together


@pytest.mark.parametrize("kv_heads,head_dim", [(2, 128), (1, 128), (1, 40)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_long_contexts_do_not_depend_on_the_batch(cache_dtype, kv_heads, head_dim):
    """Contexts of several spans: alone (a lone decode splits its kv heads between the threads, or with one
    kv head runs its spans as separate work items, folded afterwards), together (each item folds its spans
    itself) or on one thread, the same bits."""
    batch = make_batch(np.random.default_rng(8), 16, kv_heads, head_dim, 64, [1, 24, 1], [2600, 1040, 3100])
    assert_batch_invariant(batch, functools.partial(run_attention, cache_dtype=cache_dtype))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_paged_attention_output_does_not_depend_on_the_batch(isa, cache_dtype):
    """Each request alone, its prefill split into chunks, 1 or 2 threads: the same bits. The chunks of 25
    and 14 tokens run in wide register blocks, the last token alone (as a decode) in narrow ones."""
    rng = np.random.default_rng(5)
    batch = make_batch(rng, 16, 2, 128, 16, [1, 40, 1, 3], [77, 40, 16, 50])
    together = assert_batch_invariant(batch, functools.partial(run_attention, cache_dtype=cache_dtype))
    lo = int(batch["meta"][1][1])
    cache = make_cache(batch["cache"], cache_dtype)
    outs = []
    for a, b in ((0, 25), (25, 39), (39, 40)):  # each chunk sees the earlier chunks' K/V in the cache
        outs.append(ops.paged_attention(*(tensor(batch[n][lo + a:lo + b]) for n in "qkv"), cache,
                                        tensor(batch["meta"][0][lo + a:lo + b]), tensor(np.array([0, b - a])),
                                        tensor(np.array([b])), tensor(batch["meta"][3][1:2]), 16,
                                        batch["scale"]).numpy())
    np.testing.assert_array_equal(np.concatenate(outs), together[lo:lo + 40])


def test_paged_attention_rejects_bad_input():
    rng = np.random.default_rng(0)
    batch = make_batch(rng, 4, 2, 64, 16, [1], [20])
    bad = dict(batch, q=rng.standard_normal((1, 3, 64), dtype=np.float32))  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        run_attention(bad)
    tables = batch["meta"][3].copy()
    tables[0, 1] = 10_000
    with pytest.raises(ValueError, match="block_tables"):
        run_attention(dict(batch, meta=batch["meta"][:3] + [tables]))
    with pytest.raises(ValueError, match="context_lens"):
        run_attention(dict(batch, meta=batch["meta"][:2] + [np.array([0]), batch["meta"][3]]))
    with pytest.raises(ValueError, match=r"kv_cache must be \[2, num_blocks, KVH, block_size, D\]"):
        run_attention(dict(batch, cache=batch["cache"].transpose(0, 1, 3, 2, 4).copy()))  # slot-major blocks


# ---------------------------------------------------------------- norm, activation, rotary

@pytest.mark.parametrize("rows,hidden", [(1, 1024), (7, 100), (33, 37)])
def test_rms_norm_matches_reference(isa, rows, hidden):
    rng = np.random.default_rng(hidden)
    x, r = (tensor(rng.standard_normal((rows, hidden), dtype=np.float32) * 3) for _ in range(2))
    w = tensor(rng.standard_normal(hidden, dtype=np.float32))
    assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_reference(x, w, 1e-6), 1e-6)
    out, res = ops.rms_norm(x, w, 1e-5, residual=r)
    ref_out, ref_res = ops.rms_norm_reference(x, w, 1e-5, residual=r)
    assert_close(out, ref_out, 1e-6)
    np.testing.assert_array_equal(res.numpy(), ref_res.numpy())
    np.testing.assert_array_equal(out.numpy()[:1], ops.rms_norm(x[:1], w, 1e-5, residual=r[:1])[0].numpy())


@pytest.mark.parametrize("rows,ffn", [(1, 3072), (5, 37), (64, 100)])
def test_silu_and_mul_matches_reference(isa, rows, ffn):
    rng = np.random.default_rng(ffn)
    x = tensor(rng.standard_normal((rows, 2 * ffn), dtype=np.float32) * 6)
    assert_close(ops.silu_and_mul(x), ops.silu_and_mul_reference(x), 1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 2, 128), (4, 4, 64), (3, 1, 72)])
def test_rotary_in_place_matches_reference(isa, interleaved, heads, kv_heads, head_dim):
    rng = np.random.default_rng(head_dim + heads)
    positions = tensor(np.array([0, 1, 17, 4095, 131071, 5], dtype=np.int64))
    q = tensor(rng.standard_normal((6, heads, head_dim), dtype=np.float32))
    k = tensor(rng.standard_normal((6, kv_heads, head_dim), dtype=np.float32))
    inv_freq = ops.default_inv_freq(head_dim, 500000.0)
    cos, sin = ops.rotary_cos_sin(positions, inv_freq)
    ref_q, ref_k = ops.apply_rotary_reference(q, k, cos, sin, interleaved)
    out_q, out_k = ops.rotary_embedding_(positions, q, k, inv_freq, interleaved)
    assert out_q is q and out_k is k  # in place
    assert_close(q, ref_q, 1e-6)
    assert_close(k, ref_k, 1e-6)


# ---------------------------------------------------------------- weight-only linear

@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_pack_unpack_round_trip_within_quantization_error(fmt):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((300, 70), dtype=np.float32) * 0.05
    w[:, 3] = 0.0  # an all-zero column must not divide by zero
    back = ops.unpack_weight(ops.pack_weight(w, fmt)).numpy()
    err = np.abs(back - w)
    if fmt == "fp32":
        np.testing.assert_array_equal(back, w)
    elif fmt == "bf16":
        assert np.all(err <= np.abs(w) * 2.0 ** -8)  # round to nearest: half an ulp of 8 mantissa bits
    elif fmt == "int8":
        assert np.all(err <= np.abs(w).max(axis=0) / 127 / 2 * (1 + 1e-5))
    else:  # |scale| = max|W| / 8 per group; only values clipped at q = +7 can be off by more than half a step
        for g in range(0, 300, 128):
            block = slice(g, g + 128)
            step = np.abs(w[block]).max(axis=0) / 8
            assert np.all(err[block] <= step * (1 + 1e-5))
            assert np.mean(err[block] <= step / 2 * (1 + 1e-5)) > 0.99
    assert np.all(back[:, 3] == 0)


@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_packing_rounds_like_paddle_cast(transposed):
    """Round to nearest even, as Paddle's float32 -> bfloat16 cast, for contiguous and transposed views
    (the tied LM head packs the embedding's transpose); ties included."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((70, 300), dtype=np.float32)
    w.view(np.uint32)[0, :40] = (w.view(np.uint32)[0, :40] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # ties
    w = w.T if transposed else w
    want = paddle.to_tensor(np.ascontiguousarray(w)).astype("bfloat16").astype("float32").numpy()
    np.testing.assert_array_equal(ops.unpack_weight(ops.pack_weight(w, "bf16")).numpy(), want)


def test_bf16_packing_keeps_checkpoint_bits():
    bits = np.random.default_rng(0).integers(0x3000, 0x4000, size=(20, 33), dtype=np.uint16)
    back = ops.unpack_weight(ops.pack_weight(bits, "bf16")).numpy()
    np.testing.assert_array_equal(back.view(np.uint32) >> 16, bits)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("k,n", [(100, 70), (1024, 48), (13, 300)])
def test_weight_only_linear_matches_reference(isa, fmt, k, n):
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.05
    packed = ops.pack_weight(w, fmt)
    for t in (1, 2, 3, 23, 70):
        x = tensor(rng.standard_normal((t, k), dtype=np.float32))
        assert_close(ops.weight_only_linear(x, packed), ops.weight_only_linear_reference(x, packed), 2e-5)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_weight_only_linear_rows_do_not_depend_on_batch_threads_or_isa(fmt):
    rng = np.random.default_rng(11)
    packed = ops.pack_weight(rng.standard_normal((200, 100), dtype=np.float32), fmt)
    x = tensor(rng.standard_normal((70, 200), dtype=np.float32))  # 70 rows: AVX2's bf16 panels widened once per item
    batch = ops.weight_only_linear(x, packed).numpy()
    for i in (0, 5, 28, 69):
        np.testing.assert_array_equal(ops.weight_only_linear(x[i:i + 1], packed).numpy()[0], batch[i])
    for lo, rows in ((1, 2), (7, 3), (3, 6)):  # 2 and 3 rows share each weight load (GEMV-shaped); 6 is a GEMM
        np.testing.assert_array_equal(ops.weight_only_linear(x[lo:lo + rows], packed).numpy(), batch[lo:lo + rows])
    ops.set_num_threads(1)
    try:
        np.testing.assert_array_equal(ops.weight_only_linear(x, packed).numpy(), batch)
    finally:
        ops.set_num_threads(0)
    for name in ISAS:
        ops.set_isa(name)
        try:
            np.testing.assert_array_equal(ops.weight_only_linear(x, packed).numpy(), batch)
        finally:
            ops.set_isa("best")


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_long_batch_runs_in_passes_with_the_same_rows(isa, fmt):
    """A batch whose activations exceed one pass over the weights (4 MiB of rows: here 3-9 passes) gives
    every row the bits it gets in a short batch, and the reference's values."""
    rng = np.random.default_rng(21)
    packed = ops.pack_weight(rng.standard_normal((6000, 72), dtype=np.float32) * 0.02, fmt)
    x = tensor(rng.standard_normal((1500, 6000), dtype=np.float32))
    batch = ops.weight_only_linear(x, packed).numpy()
    for lo in (0, 170, 700, 1490):
        np.testing.assert_array_equal(ops.weight_only_linear(x[lo:lo + 10], packed).numpy(), batch[lo:lo + 10])
    assert_close(tensor(batch[::97]), ops.weight_only_linear_reference(x[::97], packed), 2e-5)


def test_quantized_linear_accuracy_against_fp32():
    """int8 activations per 32-k block (as llama.cpp's Q8_0) on top of the weight rounding: measured
    relative errors with outlier activation channels are ~0.014 (int8) and ~0.10 (int4)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((1024, 512), dtype=np.float32) * 0.02
    x = rng.standard_normal((16, 1024), dtype=np.float32)
    x[:, rng.choice(1024, 8, replace=False)] *= 30
    ref = x @ w
    for fmt, bound in (("bf16", 0.004), ("int8", 0.02), ("int4", 0.15)):
        y = ops.weight_only_linear(tensor(x), ops.pack_weight(w, fmt)).numpy()
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < bound, fmt


def test_weight_only_linear_keeps_leading_dims_and_rejects_bad_input():
    rng = np.random.default_rng(0)
    packed = ops.pack_weight(rng.standard_normal((64, 32), dtype=np.float32), "int8")
    x = tensor(rng.standard_normal((2, 3, 64), dtype=np.float32))
    assert ops.weight_only_linear(x, packed).shape == [2, 3, 32]
    with pytest.raises(ValueError, match="in_features"):
        ops.weight_only_linear(tensor(np.zeros((1, 63), np.float32)), packed)
    with pytest.raises(TypeError, match="float32"):
        ops.weight_only_linear(x.astype("float64"), packed)
    with pytest.raises(ValueError, match="fmt"):
        ops.pack_weight(np.zeros((4, 4), np.float32), "int3")
    with pytest.raises(ValueError, match="2-D"):
        ops.pack_weight(np.zeros(4, np.float32), "fp32")


# ---------------------------------------------------------------- fallback

def test_wrappers_fall_back_to_references_when_the_library_is_unavailable(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path / "missing")
    monkeypatch.setattr(build, "default_cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_library", None)
    with caplog.at_level(logging.WARNING, logger="fastdeploy.ops.build"):
        assert build.library() is None
        assert build.library() is None
    assert caplog.text.count("compiled CPU ops unavailable") == 1  # warned once
    assert ops.runtime_info()["compiled"] is False

    rng = np.random.default_rng(9)
    batch = make_batch(rng, 8, 2, 64, 16, [1, 4], [30, 4])
    out, cache = run_attention(batch)
    monkeypatch.setattr(build, "_library", LIB)
    compiled_out, compiled_cache = run_attention(batch)
    monkeypatch.setattr(build, "_library", None)
    assert_close(out, compiled_out, 1e-5)
    np.testing.assert_array_equal(cache.numpy(), compiled_cache.numpy())

    x = tensor(rng.standard_normal((4, 96), dtype=np.float32))
    w = tensor(rng.standard_normal(96, dtype=np.float32))
    assert_close(ops.rms_norm(x, w), ops.rms_norm(x, w, use_compiled=LIB is None), 1e-6)
    gate_up = tensor(rng.standard_normal((4, 96), dtype=np.float32))
    assert_close(ops.silu_and_mul(gate_up), ops.silu_and_mul_reference(gate_up), 0)
    q, k = tensor(rng.standard_normal((4, 2, 64), dtype=np.float32)), tensor(rng.standard_normal((4, 1, 64),
                                                                                                dtype=np.float32))
    inv_freq = ops.default_inv_freq(64, 1e4)
    expected = ops.apply_rotary_reference(q, k, *ops.rotary_cos_sin(paddle.arange(4), inv_freq), True)
    ops.rotary_embedding_(paddle.arange(4), q, k, inv_freq, True)
    assert_close(q, expected[0], 0)
    for fmt in ("fp32", "int4"):
        packed = ops.pack_weight(rng.standard_normal((96, 40), dtype=np.float32), fmt)
        fallback = ops.weight_only_linear(x, packed)
        assert_close(fallback, ops.weight_only_linear_reference(x, packed), 1e-6)
        monkeypatch.setattr(build, "_library", LIB)
        assert_close(ops.weight_only_linear(x, packed), fallback, 2e-5)
        monkeypatch.setattr(build, "_library", None)


def test_keep_freed_memory_stops_page_faults_on_reallocation():
    import resource

    def faults_per_allocation() -> float:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):
            paddle.empty([1024, 2048]).fill_(1.0)  # 8 MB: above glibc's default mmap threshold
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4

    assert ops.keep_freed_memory()
    faults_per_allocation()  # the first one grows the heap
    assert faults_per_allocation() < 64  # was ~2,000 (one per 4 KB page) per allocation
    with pytest.raises(ValueError, match="max_block_bytes"):
        ops.keep_freed_memory(64 << 20)


# ---------------------------------------------------------------- embedding lookup from a packed table

@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_embedding_lookup_is_the_tables_dequantized_rows(fmt):
    """Row `id` of the table is column `id` of the packed [hidden, vocab] matrix, exactly as unpacked;
    hidden sizes off the 32 / 128 blocks, vocab off the 16-column panels."""
    rng = np.random.default_rng(5)
    table = rng.standard_normal((37, 200), dtype=np.float32)  # [vocab, hidden]
    packed = ops.pack_weight(np.ascontiguousarray(table.T), fmt)
    ids = paddle.to_tensor(np.array([0, 36, 5, 5, 17, 31, 16, 15], dtype=np.int64))
    expected = ops.unpack_weight(packed).numpy().T[ids.numpy()]
    np.testing.assert_array_equal(ops.embedding_lookup_reference(ids, packed).numpy(), expected)
    np.testing.assert_array_equal(ops.embedding_lookup(ids, packed).numpy(), expected)
    np.testing.assert_array_equal(ops.embedding_lookup(ids.astype("int32"), packed).numpy(), expected)
    if fmt in ("fp32", "bf16"):  # unquantized: the table itself (bf16: as rounded)
        np.testing.assert_allclose(expected, table[ids.numpy()], rtol=2 ** -8)
    with pytest.raises(ValueError, match="id 37 is not in"):
        ops.embedding_lookup(paddle.to_tensor(np.array([37])), packed)
