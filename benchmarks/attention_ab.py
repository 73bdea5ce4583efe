"""A/B of two builds of the paged-attention kernel, alternating in one process.

These VMs drift by up to 1.5x within the hour, so two runs minutes apart cannot tell a 10 % change.
This script compiles custom_ops/kern_attention.inc twice into one small C++ program, as version A and
version B (another git revision's copy of the file, and/or other register-blocking constants), and
times them call by call in alternation over the same cache. It prints the median and spread of the
per-round time ratio B / A and the largest difference between their outputs (0: same bits).

    .venv/bin/python benchmarks/attention_ab.py --a-rev HEAD                    # HEAD vs the worktree
    .venv/bin/python benchmarks/attention_ab.py --isa avx2 --b-const kAttnWidenBlocks=1
    .venv/bin/python benchmarks/attention_ab.py --ctx 512 --tokens 128          # a prefill chunk

Both versions share the checkout's fd_simd.h and kern_elementwise.inc. The cache is bf16,
[2, slots, kv_heads, head_dim], its blocks in random order; `--layers` caches are cycled (18 x 8k
positions: every read from DRAM; one layer of a few thousand: from L3).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fastdeploy.ops.build import CXX_FLAGS, LD_FLAGS  # noqa: E402

SOURCES = ROOT / "custom_ops"
ISAS = {  # the includer's target, namespace and constants, as in custom_ops/isa_*.cc
    "avx512": ('#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")\n'
               "#define FD_AVX512 1\n#define FD_NS avx512\n", {"kAttnRows": 4, "kAttnWidenBlocks": 16}),
    "avx2": ('#pragma GCC target("avx2,fma,f16c,bmi2")\n#define FD_NS avx2\n',
             {"kAttnRows": 1, "kAttnWidenBlocks": 4}),
}

KERNELS = """#include <immintrin.h>
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include "fd_kernels.h"
{target}#include "fd_simd.h"
namespace fd {{ namespace FD_NS {{
#include "kern_elementwise.inc"
namespace A {{ {consts_a}
#include "{inc_a}"
}}
namespace B {{ {consts_b}
#include "{inc_b}"
}}
}} }}
void run_attention(int version, const fd::AttentionArgs& a) {{
  if (version) fd::FD_NS::B::attention(a); else fd::FD_NS::A::attention(a);
}}
"""

DRIVER = r"""#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "fd_kernels.h"
void run_attention(int version, const fd::AttentionArgs& a);
int main(int argc, char** argv) {
  const int64_t ctx = atoll(argv[1]), T = atoll(argv[2]), H = atoll(argv[3]), KVH = atoll(argv[4]),
                D = atoll(argv[5]), layers = atoll(argv[6]), rounds = atoll(argv[7]), BS = 64;
  const int64_t nb = (ctx + BS - 1) / BS + 1, S = nb * BS, row = KVH * D;
  std::mt19937 rng(0);
  std::uniform_int_distribution<int> bits(0x3E00, 0x3FFF);  // bf16 in [0.125, 2)
  std::vector<std::vector<uint16_t>> caches(layers, std::vector<uint16_t>(2 * S * row));
  for (auto& c : caches)
    for (auto& x : c) x = static_cast<uint16_t>(bits(rng) | (rng() & 1 ? 0x8000 : 0));
  std::vector<int64_t> blocks(nb);
  for (int64_t i = 0; i < nb; ++i) blocks[i] = i;
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(T * H * D), k(T * row), v(T * row), out(T * H * D), first(T * H * D);
  for (auto& x : q) x = normal(rng);
  std::vector<int64_t> slots(T, -1), q_start{0, T}, ctx_lens{ctx};  // the new K/V are not written
  fd::AttentionArgs a{q.data(), k.data(), v.data(), caches[0].data(), slots.data(), q_start.data(),
                      ctx_lens.data(), blocks.data(), out.data(), T, 1, H, KVH, D, S, nb, BS,
                      1.0f / std::sqrt(static_cast<float>(D)), true, true};
  run_attention(0, a);
  first = out;
  run_attention(1, a);
  double diff = 0;
  for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(out[i] - first[i])));
  std::vector<double> ratio, time_a, time_b;
  for (int64_t r = 0; r < rounds; ++r) {
    double t[2];
    for (int i = 0; i < 2; ++i) {
      const int version = r % 2 ? 1 - i : i;  // alternate which goes first
      const auto t0 = std::chrono::steady_clock::now();
      for (auto& c : caches) {
        a.cache = c.data();
        run_attention(version, a);
      }
      t[version] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / layers;
    }
    ratio.push_back(t[1] / t[0]);
    time_a.push_back(t[0]);
    time_b.push_back(t[1]);
  }
  for (auto* x : {&ratio, &time_a, &time_b}) std::sort(x->begin(), x->end());
  const size_t n = ratio.size();
  std::printf("A %.1f us, B %.1f us per layer (medians); B / A median %.3f, p10 %.3f, p90 %.3f; max |B - A| %.3g\n",
              time_a[n / 2] * 1e6, time_b[n / 2] * 1e6, ratio[n / 2], ratio[n / 10], ratio[n * 9 / 10], diff);
}
"""


def consts(isa: str, overrides: list[str]) -> str:
    values = dict(ISAS[isa][1])
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in values or not value.lstrip("-").isdigit():
            raise SystemExit(f"--a-const / --b-const take NAME=INT with NAME one of {sorted(values)}, got {item!r}")
        values[name] = int(value)
    return " ".join(f"constexpr int {k} = {v};" for k, v in values.items())


def label(rev: str | None, overrides: list[str]) -> str:
    return " ".join([rev or "worktree", *overrides])


def kernel_file(rev: str | None, work: Path, tag: str) -> Path:
    """kern_attention.inc of the worktree, or of git revision `rev` (written into `work`)."""
    if rev is None:
        return SOURCES / "kern_attention.inc"
    text = subprocess.run(["git", "show", f"{rev}:custom_ops/kern_attention.inc"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = work / f"kern_attention_{tag}.inc"
    path.write_text(text)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", choices=sorted(ISAS), default="avx512")
    p.add_argument("--a-rev", help="git revision whose kern_attention.inc is A (default: the worktree's)")
    p.add_argument("--b-rev", help="the same for B")
    p.add_argument("--a-const", action="append", default=[], help="NAME=INT: a constant of A (repeatable)")
    p.add_argument("--b-const", action="append", default=[], help="the same for B")
    p.add_argument("--ctx", type=int, default=4096, help="context positions (default 4096)")
    p.add_argument("--tokens", type=int, default=1, help="new tokens, the last of the context (default 1)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=1, help="caches cycled per round (default 1)")
    p.add_argument("--rounds", type=int, default=100)
    args = p.parse_args()
    if args.tokens > args.ctx or args.heads % args.kv_heads or args.head_dim % 16:
        raise SystemExit("need tokens <= ctx, heads a multiple of kv-heads and head-dim a multiple of 16")
    with tempfile.TemporaryDirectory(prefix="attention_ab-") as tmp:
        work = Path(tmp)
        target = ISAS[args.isa][0]
        (work / "kernels.cc").write_text(KERNELS.format(
            target=target, consts_a=consts(args.isa, args.a_const), consts_b=consts(args.isa, args.b_const),
            inc_a=kernel_file(args.a_rev, work, "a"), inc_b=kernel_file(args.b_rev, work, "b")))
        (work / "driver.cc").write_text(DRIVER)
        exe = work / "attention_ab"
        sources = [work / "kernels.cc", work / "driver.cc"] + [SOURCES / f for f in
                                                                ("dispatch.cc", "embedding.cc", "isa_avx512.cc", "isa_avx2.cc")]
        subprocess.run(["g++", *CXX_FLAGS, f"-I{SOURCES}", *map(str, sources), *LD_FLAGS, "-o", str(exe)], check=True)
        shape = [args.ctx, args.tokens, args.heads, args.kv_heads, args.head_dim, args.layers, args.rounds]
        print(f"{args.isa}: A = {label(args.a_rev, args.a_const)}, B = {label(args.b_rev, args.b_const)}; ctx {args.ctx}, "
              f"{args.tokens} new tokens, {args.heads} / {args.kv_heads} heads x {args.head_dim}, {args.layers} "
              f"layer(s) cycled, {args.rounds} rounds")
        subprocess.run([str(exe), *map(str, shape)], check=True)


if __name__ == "__main__":
    main()
