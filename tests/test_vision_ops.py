"""The ERNIE-4.5-VL vision tower's ops against numpy, on both instruction sets: ops.bidirectional_attention
(attention within each frame; each sequence's output does not depend on the others in the batch) and
ops.quick_gelu."""
import numpy as np
import paddle
import pytest

from fastdeploy import ops

from test_ops import isa  # noqa: F401 - the fixture running a test once per instruction set


def numpy_attention(q, k, v, starts, scale):
    out = np.zeros((q.shape[0], q.shape[1] * q.shape[2]), np.float64)
    group = q.shape[1] // k.shape[1]
    for lo, hi in zip(starts[:-1], starts[1:]):
        if hi == lo:
            continue
        keys = np.repeat(k[lo:hi], group, axis=1).astype(np.float64)  # [n, H, D]
        values = np.repeat(v[lo:hi], group, axis=1).astype(np.float64)
        scores = np.einsum("qhd,khd->hqk", q[lo:hi].astype(np.float64), keys) * scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[lo:hi] = np.einsum("hqk,khd->qhd", probs, values).reshape(hi - lo, -1)
    return out


CASES = [  # heads, kv_heads, head_dim, sequence lengths
    (2, 2, 16, [4, 16, 36]),  # the tiny fixture's tower
    (16, 16, 80, [64, 1, 100]),  # the real tower's heads (head_dim 80), a one-row sequence
    (4, 2, 32, [17, 0, 130]),  # GQA, an empty sequence, a sequence longer than one work tile
]


def make(rng, heads, kv_heads, head_dim, lens):
    t = sum(lens)
    q, k, v = (rng.standard_normal((t, h, head_dim), dtype=np.float32) for h in (heads, kv_heads, kv_heads))
    return q, k, v, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


@pytest.mark.parametrize("case", CASES)
def test_matches_numpy_attention(isa, case):  # noqa: F811
    q, k, v, starts = make(np.random.default_rng(len(case[3])), *case)
    scale = case[2] ** -0.5
    expected = numpy_attention(q, k, v, starts, scale)
    for use_compiled in (True, False):
        out = ops.bidirectional_attention(*map(paddle.to_tensor, (q, k, v)), starts, scale,
                                          use_compiled=use_compiled).numpy()
        np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


def test_a_sequence_alone_gives_the_same_bits():
    q, k, v, starts = make(np.random.default_rng(7), 4, 2, 32, [30, 50, 9])
    together = ops.bidirectional_attention(*map(paddle.to_tensor, (q, k, v)), starts, 0.2).numpy()
    for lo, hi in zip(starts[:-1], starts[1:]):
        alone = ops.bidirectional_attention(*(paddle.to_tensor(a[lo:hi]) for a in (q, k, v)),
                                            np.array([0, hi - lo]), 0.2).numpy()
        np.testing.assert_array_equal(alone, together[lo:hi])


def test_starts_must_cover_the_rows():
    q, k, v, _ = make(np.random.default_rng(0), 2, 2, 16, [5])
    with pytest.raises(ValueError, match="starts"):
        ops.bidirectional_attention(*map(paddle.to_tensor, (q, k, v)), np.array([0, 4]), 1.0)


@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (3, 17), (7, 5120 + 5)])
def test_quick_gelu_matches_numpy(isa, shape):  # noqa: F811
    x = np.random.default_rng(shape[1]).standard_normal(shape, dtype=np.float32) * 4
    expected = x.astype(np.float64) / (1 + np.exp(-1.702 * x.astype(np.float64)))
    for use_compiled in (True, False):
        out = ops.quick_gelu(paddle.to_tensor(x), use_compiled=use_compiled).numpy()
        assert out.shape == shape
        np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-6)
