"""The compiled packing op (ops.pack_into) against the numpy references, bit for bit.

Sources come in every dtype a checkpoint has (raw bfloat16 bits as uint16, float16, float32) and every
orientation the loader hands over (Paddle-layout [K, N] rows, a transposed view of an HF [N, K] tensor,
a column slice of a wider tensor), with K and N off the 16/32/128 grid. Each comparison runs for every
instruction set this CPU has.
"""
from __future__ import annotations

import os

import numpy as np
import paddle
import pytest

from fastdeploy import ops
from fastdeploy.ops import build
from fastdeploy.ops.quant import _to_bf16_bits, numpy_view

LIB = build.library()
ISAS = [name for name in ("avx512", "avx2") if LIB is not None and build.set_isa(name) == name]
if LIB is not None:
    build.set_isa("best")
FMTS = ["fp32", "bf16", "int8", "int4"]
SRC_DTYPES = ["bf16", "float16", "float32"]
ORIENTATIONS = ["rows", "transposed", "slice"]
K, N = 200, 37


@pytest.fixture(params=ISAS)
def isa(request):
    assert ops.set_isa(request.param) == request.param
    yield request.param
    ops.set_isa("best")


def weight(rng: np.random.Generator, k: int = K, n: int = N) -> np.ndarray:
    """Gaussian weights with an all-zero column and int4 groups whose largest magnitude is tied
    between opposite signs (the first in k order must win)."""
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    w[:, 3] = 0.0
    w[10, 5], w[20, 5] = 0.5, -0.5
    w[10, 6], w[20, 6] = -0.5, 0.5
    if k > 150:
        w[130, 7], w[140, 7] = -0.25, 0.25  # the second int4 group
    return w


def source(w: np.ndarray, src_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(the checkpoint-typed array, its exact float32 values)."""
    if src_dtype == "bf16":
        bits = _to_bf16_bits(w)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32)
    if src_dtype == "float16":
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    return w, w


def orient(a: np.ndarray, how: str) -> np.ndarray:
    """A view of a [K, n] with the strides a loader would see."""
    if how == "transposed":
        return np.ascontiguousarray(a.T).T
    if how == "slice":
        wide = np.zeros((a.shape[0], a.shape[1] + 21), dtype=a.dtype)
        wide[:, 7:7 + a.shape[1]] = a
        return wide[:, 7:7 + a.shape[1]]
    return a


def reference(src: np.ndarray, exact: np.ndarray, fmt: str) -> ops.PackedWeight:
    return ops.pack_weight_reference(src if fmt == "bf16" and src.dtype == np.uint16 else exact, fmt)


def assert_same(a: ops.PackedWeight, b: ops.PackedWeight) -> None:
    assert (a.fmt, a.k, a.n) == (b.fmt, b.k, b.n)
    assert list(a.data.shape) == list(b.data.shape) and a.data.dtype == b.data.dtype
    # As bytes: NaN payloads count too.
    np.testing.assert_array_equal(numpy_view(a.data).view(np.uint8), numpy_view(b.data).view(np.uint8))
    np.testing.assert_array_equal(a.scales.numpy().view(np.uint32), b.scales.numpy().view(np.uint32))


def test_library_has_the_pack_op():
    assert LIB is not None and "avx2" in ISAS


@pytest.mark.parametrize("orientation", ORIENTATIONS)
@pytest.mark.parametrize("src_dtype", SRC_DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_pack_into_matches_reference(isa, fmt, src_dtype, orientation):
    src, exact = source(weight(np.random.default_rng(1)), src_dtype)
    view = orient(src, orientation)
    want = reference(src, exact, fmt)
    for use_compiled in (True, False):
        dst = ops.empty_packed(fmt, K, N)
        ops.pack_into(dst, view, use_compiled=use_compiled)
        assert_same(dst, want)
    if not (src.dtype == np.uint16 and fmt != "bf16"):
        assert_same(ops.pack_weight(view, fmt), want)


@pytest.mark.parametrize("src_dtype", SRC_DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_fused_parts_land_at_unaligned_columns(isa, fmt, src_dtype):
    """q | k | v of widths 24, 8, 5 from differently laid out tensors share panels 1 and 2."""
    src, exact = source(weight(np.random.default_rng(2)), src_dtype)
    parts = [(0, 24, "transposed"), (24, 32, "slice"), (32, 37, "rows")]
    want = reference(src, exact, fmt)
    for use_compiled in (True, False):
        dst = ops.empty_packed(fmt, K, N)
        for lo, hi, how in parts:
            ops.pack_into(dst, orient(np.ascontiguousarray(src[:, lo:hi]), how), col0=lo, use_compiled=use_compiled)
        assert_same(dst, want)


@pytest.mark.parametrize("fmt", FMTS)
def test_stacked_experts(isa, fmt):
    rng = np.random.default_rng(3)
    experts = [source(weight(rng, 130, 21), "bf16") for _ in range(3)]
    dst = ops.empty_packed(fmt, 130, 21, experts=3)
    assert dst.num_experts == 3 and ops.empty_packed(fmt, 130, 21).num_experts == 0
    for e, (src, _) in reversed(list(enumerate(experts))):
        ops.pack_into(dst, orient(src, "transposed"), expert=e)
    for e, (src, exact) in enumerate(experts):
        one = dst.expert(e)
        assert one.data.data_ptr() == dst.data.data_ptr() + e * numpy_view(dst.data)[0].nbytes  # a view
        assert_same(one, reference(src, exact, fmt))
        alone = ops.empty_packed(fmt, 130, 21)
        ops.pack_into(alone, src)
        assert_same(one, alone)


def test_int4_ties_and_zero_columns(isa):
    w = weight(np.random.default_rng(4))
    dst = ops.empty_packed("int4", K, N)
    ops.pack_into(dst, orient(w, "transposed"))
    scales = dst.scales.numpy()  # [Np, Kp/128, 16]
    assert scales[0, 0, 5] == np.float32(0.5) / np.float32(-8)  # +0.5 came first
    assert scales[0, 0, 6] == np.float32(-0.5) / np.float32(-8)
    assert scales[0, 1, 7] == np.float32(-0.25) / np.float32(-8)
    assert scales[0, 0, 3] == 0 and (numpy_view(dst.data)[0, :, 3, :] == 0x88).all()
    dst8 = ops.empty_packed("int8", K, N)
    ops.pack_into(dst8, w)
    assert dst8.scales.numpy()[3] == 0 and (numpy_view(dst8.data)[0, :, 3, :] == 128).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_padding_columns_are_defined_before_packing(fmt):
    """empty_packed writes the last panel's unused columns with packing's zero code, so packing the
    real columns completes the buffer exactly as pack_weight fills it."""
    dst = ops.empty_packed(fmt, 70, 18, experts=2)
    want = ops.pack_weight_reference(np.zeros((70, 18), np.float32), fmt)
    got = numpy_view(dst.data)[1]
    np.testing.assert_array_equal(got[-1, :, 2:], numpy_view(want.data)[-1, :, 2:])
    if fmt == "int8":
        np.testing.assert_array_equal(dst.scales.numpy()[1, 18:].view(np.uint32),
                                      want.scales.numpy()[18:].view(np.uint32))
    if fmt == "int4":
        np.testing.assert_array_equal(dst.scales.numpy()[1, -1, :, 2:].view(np.uint32),
                                      want.scales.numpy()[-1, :, 2:].view(np.uint32))


@pytest.mark.parametrize("shape", [(1, 1), (1, 40), (33, 16), (128, 17), (257, 3)])
@pytest.mark.parametrize("fmt", FMTS)
def test_odd_shapes(isa, fmt, shape):
    rng = np.random.default_rng(5)
    w = weight(rng, *shape) if min(shape) > 7 and shape[0] > 20 else rng.standard_normal(shape).astype(np.float32)
    for how in ("rows", "transposed"):
        assert_same(ops.pack_weight(orient(w, how), fmt), ops.pack_weight_reference(w, fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_weight_only_linear_on_pack_into_weights(isa, fmt):
    rng = np.random.default_rng(6)
    src, exact = source(weight(rng), "bf16")
    dst = ops.empty_packed(fmt, K, N)
    ops.pack_into(dst, orient(src, "transposed"))
    x = paddle.to_tensor(rng.standard_normal((5, K), dtype=np.float32))
    want = ops.weight_only_linear(x, ops.pack_weight(src if fmt == "bf16" else exact, fmt))
    np.testing.assert_array_equal(ops.weight_only_linear(x, dst).numpy(), want.numpy())


@pytest.mark.parametrize("fmt", FMTS)
def test_large_weights_across_threads(isa, fmt):
    """Wide enough for several multi-panel work items per thread; one thread or two, the same bits."""
    src, exact = source(weight(np.random.default_rng(7), 300, 1000), "float16")
    want = reference(src, exact, fmt)
    for threads in (1, 2):
        ops.set_num_threads(threads)
        try:
            for how in ("rows", "transposed"):
                dst = ops.empty_packed(fmt, 300, 1000)
                ops.pack_into(dst, orient(src[:, :203], how))
                ops.pack_into(dst, orient(src[:, 203:], how), col0=203)
                assert_same(dst, want)
        finally:
            ops.set_num_threads(0)


def test_empty_packed_leaves_the_bulk_unallocated():
    def rss() -> int:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    dst = ops.empty_packed("bf16", 4096, 8192 + 5)  # 64 MB
    assert rss() - before < 16 << 20
    del dst


def test_packed_weights_are_backed_by_huge_pages_where_the_kernel_offers_them():
    """empty_packed asks for transparent huge pages before anything is written; with THP "never" the memory
    simply stays in 4 KiB pages."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        offered = "[never]" not in f.read()
    dst = ops.empty_packed("int8", 8192, 8192)  # 64 MiB: its own mapping (malloc maps anything over 32 MiB)
    lo = dst.data.data_ptr()
    hi = lo + 8192 * 8192
    numpy_view(dst.data)[...] = 1
    huge_kb = 0  # over the mappings that hold the weight (madvise splits its mapping at 2 MiB boundaries)
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start < hi and lo < end
            elif inside and head == "AnonHugePages:":
                huge_kb += int(line.split()[1])
    assert (huge_kb >= 32 << 10) if offered else huge_kb == 0, huge_kb
    del dst


def test_bad_arguments_name_the_parameter():
    dst = ops.empty_packed("int8", 8, 20)
    stacked = ops.empty_packed("int4", 8, 20, experts=2)
    ok = np.zeros((8, 4), np.float32)
    with pytest.raises(ValueError, match="src"):
        ops.pack_into(dst, np.zeros((8, 4, 1), np.float32))
    with pytest.raises(ValueError, match="src"):
        ops.pack_into(dst, np.zeros((9, 4), np.float32))
    with pytest.raises(TypeError, match="src dtype"):
        ops.pack_into(dst, ok.astype(np.float64))
    with pytest.raises(TypeError, match="src"):
        ops.pack_into(dst, paddle.zeros([8, 4]))
    with pytest.raises(ValueError, match="strides"):
        ops.pack_into(dst, ok[::-1])
    with pytest.raises(ValueError, match="col0"):
        ops.pack_into(dst, ok, col0=17)
    with pytest.raises(ValueError, match="col0"):
        ops.pack_into(dst, ok, col0=-1)
    with pytest.raises(TypeError, match="col0"):
        ops.pack_into(dst, ok, col0=1.0)
    with pytest.raises(ValueError, match="expert"):
        ops.pack_into(stacked, ok, expert=2)
    with pytest.raises(ValueError, match="expert"):
        ops.pack_into(stacked, ok)
    with pytest.raises(ValueError, match="expert"):
        ops.pack_into(dst, ok, expert=0)
    with pytest.raises(TypeError, match="dst"):
        ops.pack_into(object(), ok)
    with pytest.raises(ValueError, match="fmt"):
        ops.empty_packed("int2", 8, 20)
    with pytest.raises(ValueError, match="experts"):
        ops.empty_packed("int8", 8, 20, experts=-1)
    with pytest.raises(ValueError, match="expert"):
        stacked.expert(5)


@pytest.mark.parametrize("src_dtype", ["bf16", "float16"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_every_16_bit_pattern_converts_like_numpy(isa, fmt, src_dtype):
    """All 65536 bfloat16 / float16 bit patterns, NaNs (signalling ones too), infinities and subnormals
    included: the unquantized formats keep numpy's bits."""
    bits = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    src = bits if src_dtype == "bf16" else bits.view(np.float16)
    exact = (bits.astype(np.uint32) << 16).view(np.float32) if src_dtype == "bf16" else src.astype(np.float32)
    want = reference(src, exact, fmt)
    for how in ("rows", "transposed", "slice"):
        dst = ops.empty_packed(fmt, 256, 256)
        ops.pack_into(dst, orient(src, how))
        np.testing.assert_array_equal(numpy_view(dst.data).view(np.uint8), numpy_view(want.data).view(np.uint8))


@pytest.mark.parametrize("fmt", FMTS)
def test_subnormal_and_huge_magnitudes(isa, fmt):
    """Subnormal weights (and int8/int4 scales), and weights near float32's largest value."""
    w = np.random.default_rng(8).standard_normal((300, 100)).astype(np.float32)
    w[:, :40] *= np.float32(1e-39)
    w[:, 40:60] *= np.float32(1e-36)
    w[:, 60:70] = np.float32(1e38) * np.sign(w[:, 60:70])
    for how in ("rows", "transposed"):
        assert_same(ops.pack_weight(orient(w, how), fmt), ops.pack_weight_reference(w, fmt))
