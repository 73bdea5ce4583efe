"""Microbenchmarks of the compiled CPU ops against numpy (OpenBLAS) and paddle.matmul.

    .venv/bin/python benchmarks/ops_microbench.py                 # everything, 2 threads
    .venv/bin/python benchmarks/ops_microbench.py --only gemv --threads 1 --isa avx2
    .venv/bin/python benchmarks/ops_microbench.py --only gemv_large --isa avx2   # 21B-A3B shapes, best of 7

GEMV (one token): GB/s of weight bytes streamed, at the ERNIE-4.5-0.3B shapes. Each shape gets enough
distinct weight copies (>= 256 MB) that every call reads DRAM, not the 32 MB L3, as a real decode step
through 18 layers does. GEMM: GFLOP/s for T = 16 / 128 / 2048 tokens. Attention: one decode step of
16 requests x 512-token contexts (16 q heads, 2 kv heads, head_dim 128), per layer; attention_long:
one stream at 1k-8k contexts, K/V read from DRAM. Pack: GB/s of
checkpoint bytes packed by ops.pack_into per source dtype, orientation and format. Timings are the
median of repeats; this machine class is noisy, so compare within one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paddle

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fastdeploy import ops  # noqa: E402

GEMV_SHAPES = [("qkv", 1024, 2560), ("o_proj", 2048, 1024), ("up_gate", 1024, 6144), ("down", 3072, 1024),
               ("lm_head", 1024, 103424)]
GEMM_SHAPES = [("up_gate", 1024, 6144), ("down", 3072, 1024)]
FORMATS = ["fp32", "bf16", "int8", "int4"]


def timeit(fn: Callable[[int], object], calls: int, repeats: int = 5) -> float:
    """Median seconds per call of fn(i) over `repeats` rounds of `calls` calls."""
    fn(0)
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def copies_for(nbytes: int) -> int:
    return max(1, -(-256 * 2**20 // nbytes))


def packed_copies(w: np.ndarray, fmt: str) -> tuple[ops.PackedWeight, list[ops.PackedWeight]]:
    """W packed, and enough distinct copies of it that calls cycling through them read from DRAM."""
    packed = ops.pack_weight(w, fmt)
    k, n = w.shape
    return packed, [packed] + [ops.PackedWeight(fmt, k, n, packed.data.clone(), packed.scales.clone())
                               for _ in range(copies_for(packed.nbytes) - 1)]


def bench_gemv(rng: np.random.Generator) -> None:
    print("\nGEMV, T = 1: GB/s of weights read (time per call)")
    header = f"{'shape':>22} " + " ".join(f"{f:>17}" for f in FORMATS) + f" {'numpy fp32':>17} {'paddle fp32':>17}"
    print(header)
    for name, k, n in GEMV_SHAPES:
        w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
        x = paddle.to_tensor(rng.standard_normal((1, k), dtype=np.float32))
        cells = []
        for fmt in FORMATS:
            packed, reps = packed_copies(w, fmt)
            t = timeit(lambda i: ops.weight_only_linear(x, reps[i % len(reps)]), calls=len(reps) * 2)
            cells.append(f"{packed.nbytes / t / 1e9:7.1f} ({t * 1e3:5.2f}ms)")
            del reps, packed
        dense = [w] + [w.copy() for _ in range(copies_for(w.nbytes) - 1)]
        xn = x.numpy()
        t = timeit(lambda i: xn @ dense[i % len(dense)], calls=len(dense) * 2)
        cells.append(f"{w.nbytes / t / 1e9:7.1f} ({t * 1e3:5.2f}ms)")
        dense_pd = [paddle.to_tensor(d) for d in dense]
        del dense
        t = timeit(lambda i: paddle.matmul(x, dense_pd[i % len(dense_pd)]), calls=len(dense_pd) * 2)
        cells.append(f"{w.nbytes / t / 1e9:7.1f} ({t * 1e3:5.2f}ms)")
        del dense_pd
        print(f"{f'{name} {k}x{n}':>22} " + " ".join(f"{c:>17}" for c in cells))


def bench_gemv_rows(rng: np.random.Generator) -> None:
    """A decode step of a few streams: T = 1..4 rows against weights read from DRAM. Rows up to three share
    each weight load, so their time should stay near T = 1's; T = 4 is the first GEMM-shaped batch."""
    name, k, n = GEMM_SHAPES[0]
    print(f"\nGEMV rows, {name} {k}x{n}: us per call for T = 1 / 2 / 3 / 4 rows")
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
    for fmt in ("bf16", "int8", "int4"):
        _, reps = packed_copies(w, fmt)
        cells = []
        for t in (1, 2, 3, 4):
            x = paddle.to_tensor(rng.standard_normal((t, k), dtype=np.float32))
            cells.append(timeit(lambda i: ops.weight_only_linear(x, reps[i % len(reps)]), calls=len(reps) * 2))
        print(f"{fmt:>6} " + " ".join(f"T={t}: {c * 1e6:6.0f}" for t, c in zip((1, 2, 3, 4), cells)))
        del reps


# Larger decode GEMVs (ERNIE-4.5-21B-A3B: attention/shared-MLP 2560 x 3072, an expert's 1536 x 2560,
# the LM head 2560 x 103424), weight-only formats only.
GEMV_LARGE_SHAPES = [("2560x3072", 2560, 3072), ("1536x2560", 1536, 2560), ("lm_head", 2560, 103424)]
GEMV_LARGE_FORMATS = ["bf16", "int8", "int4"]


def bench_gemv_large(rng: np.random.Generator) -> None:
    """GB/s of weights read per one-token call, best of 7 rounds (a shared machine's noise only slows
    rounds down), weights streamed from DRAM (>= 256 MB of distinct copies)."""
    print("\nGEMV large, T = 1: GB/s of weights read, best of 7 rounds (time per call)")
    print(f"{'shape':>22} " + " ".join(f"{f:>17}" for f in GEMV_LARGE_FORMATS))
    for name, k, n in GEMV_LARGE_SHAPES:
        w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
        x = paddle.to_tensor(rng.standard_normal((1, k), dtype=np.float32))
        cells = []
        for fmt in GEMV_LARGE_FORMATS:
            packed, reps = packed_copies(w, fmt)
            calls = max(8, len(reps) * 2)
            ops.weight_only_linear(x, reps[0])
            best = float("inf")
            for _ in range(7):
                start = time.perf_counter()
                for i in range(calls):
                    ops.weight_only_linear(x, reps[i % len(reps)])
                best = min(best, (time.perf_counter() - start) / calls)
            cells.append(f"{packed.nbytes / best / 1e9:7.1f} ({best * 1e3:5.2f}ms)")
            del reps, packed
        print(f"{f'{name} {k}x{n}':>22} " + " ".join(f"{c:>17}" for c in cells))


def bench_gemm(rng: np.random.Generator) -> None:
    print("\nGEMM: GFLOP/s (time per call)")
    print(f"{'shape':>26} " + " ".join(f"{f:>17}" for f in FORMATS) + f" {'numpy fp32':>17} {'paddle fp32':>17}")
    for name, k, n in GEMM_SHAPES:
        w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
        packed = {fmt: ops.pack_weight(w, fmt) for fmt in FORMATS}
        wp = paddle.to_tensor(w)
        for t_rows in (16, 128, 2048):
            x = paddle.to_tensor(rng.standard_normal((t_rows, k), dtype=np.float32))
            xn = x.numpy()
            flops = 2.0 * t_rows * k * n
            calls = max(1, int(2e9 // flops))
            cells = []
            for fmt in FORMATS:
                t = timeit(lambda i: ops.weight_only_linear(x, packed[fmt]), calls)
                cells.append(f"{flops / t / 1e9:7.1f} ({t * 1e3:6.2f}ms)")
            t = timeit(lambda i: xn @ w, calls)
            cells.append(f"{flops / t / 1e9:7.1f} ({t * 1e3:6.2f}ms)")
            t = timeit(lambda i: paddle.matmul(x, wp), calls)
            cells.append(f"{flops / t / 1e9:7.1f} ({t * 1e3:6.2f}ms)")
            print(f"{f'{name} {k}x{n} T={t_rows}':>26} " + " ".join(f"{c:>17}" for c in cells))


def int8_accuracy(rng: np.random.Generator) -> None:
    """Relative error of the quantized products against the fp32 product (random weights, activations
    with a few 30x outlier channels as LLM hidden states have)."""
    print("\nAccuracy vs fp32, ||y - y_fp32|| / ||y_fp32||, K=1024 N=3072 T=64")
    k, n = 1024, 3072
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
    xn = rng.standard_normal((64, k), dtype=np.float32)
    xn[:, rng.choice(k, 8, replace=False)] *= 30
    x = paddle.to_tensor(xn)
    ref = xn @ w
    for fmt in FORMATS:
        packed = ops.pack_weight(w, fmt)
        y = ops.weight_only_linear(x, packed).numpy()
        y_wo = ops.weight_only_linear_reference(x, packed, quantize_activations=False).numpy()
        print(f"  {fmt:>5}: kernel {np.linalg.norm(y - ref) / np.linalg.norm(ref):.5f}   "
              f"weight rounding alone {np.linalg.norm(y_wo - ref) / np.linalg.norm(ref):.5f}")


def bench_attention(rng: np.random.Generator) -> None:
    b, ctx, h, kvh, d, bs = 16, 512, 16, 2, 128, 64
    print(f"\nPaged attention, decode: {b} requests x {ctx}-token contexts, H={h} KVH={kvh} D={d} block={bs}")
    blocks_per = ctx // bs
    num_blocks = b * blocks_per + 8
    cache = paddle.to_tensor(rng.standard_normal((2, num_blocks, kvh, bs, d), dtype=np.float32))
    tables = rng.permutation(num_blocks)[: b * blocks_per].reshape(b, blocks_per).astype(np.int32)
    slots = tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs
    q = paddle.to_tensor(rng.standard_normal((b, h, d), dtype=np.float32))
    k = paddle.to_tensor(rng.standard_normal((b, kvh, d), dtype=np.float32))
    v = paddle.to_tensor(rng.standard_normal((b, kvh, d), dtype=np.float32))
    meta = [paddle.to_tensor(slots.astype(np.int64)), paddle.to_tensor(np.arange(b + 1, dtype=np.int32)),
            paddle.to_tensor(np.full(b, ctx, dtype=np.int32)), paddle.to_tensor(tables)]
    kv_bytes = b * ctx * kvh * d * 4 * 2
    t = timeit(lambda i: ops.paged_attention(q, k, v, cache, *meta, bs, d ** -0.5), calls=20)
    print(f"  compiled:  {t * 1e3:7.3f} ms/layer  ({kv_bytes / t / 1e9:5.1f} GB/s of K/V; {kv_bytes / 2**20:.0f} MB"
          f" per layer, so mostly L3-resident here)")
    t = timeit(lambda i: ops.paged_attention_reference(q, k, v, cache, *meta, bs, d ** -0.5), calls=3, repeats=3)
    print(f"  reference: {t * 1e3:7.3f} ms/layer (pure Paddle, one request at a time)")


def bench_attention_long(rng: np.random.Generator) -> None:
    """One decode stream at long contexts, 18 layers' bf16 caches cycled so that every K/V read comes from
    DRAM, as in a real step (the weights streamed in between evict them)."""
    h, kvh, d, bs, layers = 16, 2, 128, 64, 18
    print(f"\nPaged attention, one decode stream, bf16 cache, {layers} layers cycled, H={h} KVH={kvh} D={d}")
    for ctx in (1024, 4096, 8192):
        blocks = ctx // bs
        caches = [paddle.to_tensor(rng.standard_normal((2, blocks + 4, kvh, bs, d), dtype=np.float32))
                  .astype("bfloat16") for _ in range(layers)]
        tables = rng.permutation(blocks + 4)[:blocks].reshape(1, blocks).astype(np.int64)
        q = paddle.to_tensor(rng.standard_normal((1, h, d), dtype=np.float32))
        k, v = (paddle.to_tensor(rng.standard_normal((1, kvh, d), dtype=np.float32)) for _ in range(2))
        meta = [paddle.to_tensor(tables[:, -1:] * bs + bs - 1), paddle.to_tensor(np.array([0, 1])),
                paddle.to_tensor(np.array([ctx])), paddle.to_tensor(tables)]
        t = timeit(lambda i: ops.paged_attention(q, k, v, caches[i % layers], *meta, bs, d ** -0.5), calls=layers * 4)
        kv_bytes = ctx * kvh * d * 2 * 2
        print(f"  ctx {ctx:5d}: {t * 1e6:7.0f} us/layer ({kv_bytes / t / 1e9:5.1f} GB/s of K/V)")
        del caches


def bench_elementwise(rng: np.random.Generator) -> None:
    print("\nElementwise, hidden 1024 / ffn 3072 / 16 heads x 128: compiled vs reference (us per call)")
    for t_rows in (1, 16, 2048):
        x = paddle.to_tensor(rng.standard_normal((t_rows, 1024), dtype=np.float32))
        r = paddle.to_tensor(rng.standard_normal((t_rows, 1024), dtype=np.float32))
        w = paddle.to_tensor(rng.standard_normal(1024, dtype=np.float32))
        g = paddle.to_tensor(rng.standard_normal((t_rows, 6144), dtype=np.float32))
        q = paddle.to_tensor(rng.standard_normal((t_rows, 16, 128), dtype=np.float32))
        kk = paddle.to_tensor(rng.standard_normal((t_rows, 2, 128), dtype=np.float32))
        cos, sin = ops.rotary_cos_sin(paddle.arange(t_rows), ops.default_inv_freq(128, 500000.0))
        calls = 200 if t_rows < 100 else 20
        rows = [
            ("add_rms_norm", lambda i: ops.rms_norm(x, w, 1e-5, r), lambda i: ops.rms_norm_reference(x, w, 1e-5, r)),
            ("silu_and_mul", lambda i: ops.silu_and_mul(g), lambda i: ops.silu_and_mul_reference(g)),
            ("rotary (in place)", lambda i: ops.apply_rotary_(q, kk, cos, sin, True),
             lambda i: ops.apply_rotary_reference(q, kk, cos, sin, True)),
        ]
        for name, fast, ref in rows:
            tf, tr = timeit(fast, calls), timeit(ref, calls)
            print(f"  T={t_rows:<5} {name:<18} {tf * 1e6:9.1f} {tr * 1e6:9.1f}")


def bench_model_step(rng: np.random.Generator) -> None:
    """One decode step of an ERNIE-4.5-0.3B-shaped model (18 layers, hidden 1024, 16 x 128 q heads, 2 kv
    heads, ffn 3072, vocab 103424) built from these ops alone: no engine, sampler or Python scheduling,
    so an upper bound for LLM.generate. Contexts of 256 tokens; the LM head in the layers' format."""
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab, ctx, bs = 18, 1024, 16, 2, 128, 3072, 103424, 256, 64
    print(f"\nModel step (decode, {layers} layers, context {ctx}): ms per step and output tokens/s")
    shapes = {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, hidden),
              "up_gate": (hidden, 2 * ffn), "down": (ffn, hidden)}
    dense = {name: rng.standard_normal(shape, dtype=np.float32) * 0.02 for name, shape in shapes.items()}
    head = rng.standard_normal((hidden, vocab), dtype=np.float32) * 0.02
    norm_w = paddle.ones([hidden])
    for fmt in FORMATS:
        # Distinct copies per layer so that every step streams all the weights from memory.
        first = {name: ops.pack_weight(w, fmt) for name, w in dense.items()}
        weights = [first] + [{n: ops.PackedWeight(fmt, p.k, p.n, p.data.clone(), p.scales.clone())
                              for n, p in first.items()} for _ in range(layers - 1)]
        lm_head = ops.pack_weight(head, fmt)
        nbytes = sum(p.nbytes for w in weights for p in w.values()) + lm_head.nbytes
        for batch in (1, 16):
            blocks = ctx // bs + 1
            caches = [paddle.zeros([2, batch * blocks, kv_heads, bs, head_dim]) for _ in range(layers)]
            tables = np.arange(batch * blocks, dtype=np.int64).reshape(batch, blocks)
            meta = [paddle.to_tensor(tables[:, ctx // bs] * bs + ctx % bs), paddle.arange(batch + 1, dtype="int64"),
                    paddle.full([batch], ctx + 1, dtype="int64"), paddle.to_tensor(tables)]
            cos, sin = ops.rotary_cos_sin(paddle.full([batch], ctx, dtype="int64"),
                                          ops.default_inv_freq(head_dim, 500000.0))
            x0 = paddle.to_tensor(rng.standard_normal((batch, hidden), dtype=np.float32))

            def step(_: int) -> None:
                hidden_states, residual = x0, x0
                for w, cache in zip(weights, caches):
                    h, residual = ops.rms_norm(hidden_states, norm_w, 1e-5, residual)
                    q, k, v = paddle.split(ops.weight_only_linear(h, w["qkv"]),
                                           [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], axis=-1)
                    q, k, v = (t.reshape([batch, -1, head_dim]) for t in (q, k, v))
                    ops.apply_rotary_(q, k, cos, sin, True)
                    attn = ops.paged_attention(q, k, v, cache, *meta, bs, head_dim ** -0.5)
                    h, residual = ops.rms_norm(ops.weight_only_linear(attn, w["o"]), norm_w, 1e-5, residual)
                    hidden_states = ops.weight_only_linear(ops.silu_and_mul(ops.weight_only_linear(h, w["up_gate"])),
                                                           w["down"])
                h, _ = ops.rms_norm(hidden_states, norm_w, 1e-5, residual)
                ops.weight_only_linear(h, lm_head).numpy()

            t = timeit(step, calls=3, repeats=3)
            print(f"  {fmt:>5} batch {batch:>2}: {t * 1e3:7.1f} ms/step  {batch / t:7.1f} tok/s"
                  f"  (weights {nbytes / 2**20:.0f} MB, {nbytes / t / 1e9:.1f} GB/s)")
        del weights, lm_head, first


def bench_pack(rng: np.random.Generator) -> None:
    """ops.pack_into from a checkpoint-typed source ([2048, 6144], 24 MB of bf16: past L2, like a real
    tensor) into a reused destination: GB/s of source bytes, per source dtype, orientation and format."""
    from fastdeploy.ops.quant import _to_bf16_bits

    k, n = 2048, 6144
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
    sources = {"bf16": _to_bf16_bits(w), "float16": w.astype(np.float16)}
    print(f"\npack_into [{k}, {n}]: GB/s of source read (rows = Paddle [in, out]; transposed = HF [out, in] view)")
    print(f"{'source':>22} " + " ".join(f"{f:>8}" for f in FORMATS))
    for name, src in sources.items():
        for how, view in (("rows", src), ("transposed", np.ascontiguousarray(src.T).T)):
            cells = []
            for fmt in FORMATS:
                dst = ops.empty_packed(fmt, k, n)
                t = timeit(lambda _: ops.pack_into(dst, view), calls=3)
                cells.append(f"{view.nbytes / t / 1e9:8.2f}")
            print(f"{name + ' ' + how:>22} " + " ".join(cells))


BENCHES: dict[str, Callable[[np.random.Generator], None]] = {
    "gemv": bench_gemv, "gemv_rows": bench_gemv_rows, "gemv_large": bench_gemv_large, "gemm": bench_gemm,
    "accuracy": int8_accuracy, "attention": bench_attention, "attention_long": bench_attention_long,
    "elementwise": bench_elementwise, "step": bench_model_step, "pack": bench_pack}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma list of {list(BENCHES)}")
    parser.add_argument("--threads", type=int, default=0, help="0: one per core")
    parser.add_argument("--isa", default="best", choices=["best", "avx512_bf16", "avx512", "avx2"])
    args = parser.parse_args()
    names = args.only.split(",")
    unknown = [name for name in names if name not in BENCHES]
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {list(BENCHES)}")
    if ops.library() is None:
        sys.exit("the compiled ops are unavailable on this machine (see the warning above)")
    ops.set_num_threads(args.threads)
    ops.set_isa(args.isa)
    print("compiled ops:", ops.runtime_info())
    rng = np.random.default_rng(0)
    for name in names:
        BENCHES[name](rng)


if __name__ == "__main__":
    main()
