"""Microbenchmark of the fused MoE op (fd_moe) at the ERNIE-4.5-21B-A3B MoE-layer shape.

    .venv/bin/python benchmarks/moe_microbench.py                      # int4, int8, bf16; 2 threads
    .venv/bin/python benchmarks/moe_microbench.py --formats int4 --tokens 1 --isa avx2

Shape: hidden 2560, 64 experts, top-6, expert intermediate 1536, shared experts 2 x 1536 (one MLP of
3072), fp32 router. Per call: time of ops.fused_moe against today's Python path (routing in Paddle, then
a loop over the active experts calling the compiled weight_only_linear / silu_and_mul, i.e.
grouped_expert_forward). At T = 1 also GB/s: bytes of the router, the 6 chosen experts and the shared
MLP divided by the time, against the machine's read bandwidth (--bandwidth, GB/s).

All 64 experts' weights are distinct memory (8 random experts tiled to 64 copies: packing 64 is slow)
and each call routes a different token, so the chosen experts come from DRAM, not the L3 cache; the
shared MLP and the router rotate through enough copies (>= 256 MB) for the same reason.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fastdeploy import ops  # noqa: E402
from fastdeploy.ops.moe import grouped_expert_forward, select_experts  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER, SHARED_INTER = 2560, 64, 6, 1536, 3072
DISTINCT = 8  # distinct random experts, tiled to EXPERTS copies


def timeit(fn: Callable[[int], object], calls: int, repeats: int = 5) -> float:
    """Best seconds per call of fn(i) over `repeats` rounds of `calls` calls (the best round: this
    machine class is shared and noisy; the best is the op's own speed)."""
    fn(0)
    rounds = []
    for r in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(r * calls + i + 1)
        rounds.append((time.perf_counter() - start) / calls)
    return min(rounds)


def stacked(rng: np.random.Generator, k: int, n: int, fmt: str) -> ops.PackedWeight:
    packed = [ops.pack_weight(rng.standard_normal((k, n), dtype=np.float32) * 0.02, fmt) for _ in range(DISTINCT)]
    reps = [EXPERTS // DISTINCT] + [1] * len(packed[0].data.shape)
    # Tiled in numpy (Paddle's tile has no bfloat16 kernel): bf16 data travels as its uint16 bits.
    raw = [p.data.view(paddle.uint16) if fmt == "bf16" else p.data for p in packed]
    data = paddle.to_tensor(np.tile(np.stack([r.numpy() for r in raw]), reps))
    if fmt == "bf16":
        data = data.view(paddle.bfloat16)
    scales = packed[0].scales
    if fmt in ("int8", "int4"):
        scales = paddle.to_tensor(np.tile(np.stack([p.scales.numpy() for p in packed]),
                                          [EXPERTS // DISTINCT] + [1] * len(packed[0].scales.shape)))
    return ops.PackedWeight(fmt, k, n, data, scales)


def python_path(x: paddle.Tensor, router: ops.PackedWeight, bias: paddle.Tensor, up_gate: ops.PackedWeight,
                down: ops.PackedWeight, shared: tuple[ops.PackedWeight, ops.PackedWeight],
                views: list[tuple[ops.PackedWeight, ops.PackedWeight]]) -> paddle.Tensor:
    """Today's layers/moe.py path with compiled GEMMs: Paddle routing, a Python loop over experts."""
    probs = F.softmax(ops.weight_only_linear(x, router), axis=-1)
    weights, ids = select_experts(probs, TOP_K, bias, 1e-12)
    experts = [lambda rows, u=u, d=d: ops.weight_only_linear(ops.silu_and_mul(ops.weight_only_linear(rows, u)), d)
               for u, d in views]
    out = grouped_expert_forward(x, weights, ids, experts)
    return out + ops.weight_only_linear(ops.silu_and_mul(ops.weight_only_linear(x, shared[0])), shared[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="int4,int8,bf16")
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument("--threads", type=int, default=0, help="0: one per core")
    parser.add_argument("--isa", default="best", choices=["best", "avx512_bf16", "avx512", "avx2"])
    parser.add_argument("--bandwidth", type=float, default=29.5, help="the machine's DRAM read GB/s")
    args = parser.parse_args()
    if ops.library() is None:
        sys.exit("the compiled ops are unavailable on this machine (see the warning above)")
    ops.set_num_threads(args.threads)
    ops.set_isa(args.isa)
    print("compiled ops:", ops.runtime_info())
    print(f"MoE layer: hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K}, intermediate {INTER}, shared "
          f"{SHARED_INTER}; ms per call (best of 5 rounds)")
    rng = np.random.default_rng(0)
    router = ops.pack_weight(rng.standard_normal((HIDDEN, EXPERTS), dtype=np.float32) * 0.02, "fp32")
    bias = paddle.to_tensor(rng.standard_normal(EXPERTS, dtype=np.float32) * 1e-3)
    inputs = paddle.to_tensor(rng.standard_normal((4096, HIDDEN), dtype=np.float32))
    for fmt in args.formats.split(","):
        up_gate, down = stacked(rng, HIDDEN, 2 * INTER, fmt), stacked(rng, INTER, HIDDEN, fmt)
        shared0 = (ops.pack_weight(rng.standard_normal((HIDDEN, 2 * SHARED_INTER), dtype=np.float32) * 0.02, fmt),
                   ops.pack_weight(rng.standard_normal((SHARED_INTER, HIDDEN), dtype=np.float32) * 0.02, fmt))
        # Copies of the shared MLP and the router, one per call in turn, so that they too come from DRAM
        # (as in a model, where the other layers' weights evict them between two calls of this layer).
        copies = max(2, -(-256 * 2**20 // (shared0[0].nbytes + shared0[1].nbytes)))
        shareds = [shared0] + [tuple(ops.PackedWeight(fmt, p.k, p.n, p.data.clone(), p.scales.clone()) for p in shared0)
                               for _ in range(copies - 1)]
        routers = [router] + [ops.PackedWeight("fp32", router.k, router.n, router.data.clone(), router.scales)
                              for _ in range(copies - 1)]
        shared = shared0
        views = [(up_gate.expert(e), down.expert(e)) for e in range(EXPERTS)]
        expert_bytes = (up_gate.nbytes + down.nbytes) / EXPERTS
        step_bytes = TOP_K * expert_bytes + shared[0].nbytes + shared[1].nbytes + router.nbytes
        for t_rows in (int(t) for t in args.tokens.split(",")):
            def batch(i: int) -> paddle.Tensor:
                start = (i * t_rows) % (inputs.shape[0] - t_rows + 1)
                return inputs[start:start + t_rows]

            batches = [batch(i).contiguous() for i in range(64)]
            calls = 50 if t_rows == 1 else 10
            fused = timeit(lambda i: ops.fused_moe(batches[i % 64], routers[i % copies], bias, up_gate, down, TOP_K,
                                                   1e-12, 0, EXPERTS, *shareds[i % copies]), calls)
            loop = timeit(lambda i: python_path(batches[i % 64], routers[i % copies], bias, up_gate, down,
                                                shareds[i % copies], views), max(3, calls // 5))
            line = f"  {fmt:>5} T={t_rows:<4} fused {fused * 1e3:7.2f} ms   python loop {loop * 1e3:7.2f} ms" \
                   f"   ({loop / fused:4.1f}x)"
            if t_rows == 1:
                gbs = step_bytes / fused / 1e9
                line += (f"   {step_bytes / 2**20:.0f} MB read: {gbs:5.1f} GB/s = {100 * gbs / args.bandwidth:4.0f}%"
                         f" of {args.bandwidth} GB/s")
            print(line, flush=True)
        del up_gate, down, shared, shared0, shareds, routers, views


if __name__ == "__main__":
    main()
