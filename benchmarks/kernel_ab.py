"""A/B of two builds of one compiled kernel (paged attention, the linear layer or the MoE layer), alternating in one
process.

These VMs drift by up to 1.5x within the hour, so two runs minutes apart cannot tell a 10 % change.
This script compiles custom_ops/kern_<kernel>.inc twice into one small C++ program, as version A and
version B (another git revision's copy of the file, and/or other values of the register-blocking
constants of custom_ops/isa_<isa>.cc), and times them call by call in alternation on the same data.
It prints the median and spread of the per-round time ratio B / A and the largest difference between
their outputs (0: the same bits).

    .venv/bin/python benchmarks/kernel_ab.py attention --a-rev HEAD            # HEAD vs the worktree
    .venv/bin/python benchmarks/kernel_ab.py attention --isa avx2 --b-const kAttnWidenBlocks=100
    .venv/bin/python benchmarks/kernel_ab.py attention --ctx 512 --tokens 128   # a prefill chunk
    .venv/bin/python benchmarks/kernel_ab.py linear --format int4 --isa avx2 --b-const kGemvPrefetch=0
    .venv/bin/python benchmarks/kernel_ab.py linear --rows 16 --k 1024 --n 6144 --format int8
    .venv/bin/python benchmarks/kernel_ab.py moe --rows 16 --format bf16 --isa avx2   # 21B-A3B's MoE layer, 16 tokens

Both versions share the checkout's fd_simd.h and kern_elementwise.inc. Attention: a bf16 cache
[2, blocks, kv_heads, 64, head_dim] with its blocks in random order, `--layers` caches cycled (18 x 8k
positions: every read from DRAM; one layer of a few thousand: from L3). Linear: y = x W with W packed
from random float32 [k, n], as many copies cycled as make --cycle-mb MB (default 256: every weight read from DRAM).
MoE (kern_moe.inc over kern_linear.inc, both from the version's revision): --experts stacked experts in their own
memory, 16 batches of --rows random tokens in turn, so each call routes to other experts, read from DRAM.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fastdeploy.ops.build import CXX_FLAGS, LD_FLAGS  # noqa: E402

SOURCES = ROOT / "custom_ops"
TARGETS = {"avx512_bf16": ("avx512", 3), "avx512": ("avx512", 2), "avx2": ("avx2", 1)}  # ISA unit, driver's level


def target_lines(unit: str) -> str:
    """The `#pragma GCC` / `#define FD_` lines custom_ops/isa_<unit>.cc puts before fd_simd.h."""
    text = (SOURCES / f"isa_{unit}.cc").read_text()
    head = text[:text.index('#include "fd_simd.h"')]
    return "".join(line + "\n" for line in head.splitlines() if line.startswith(("#pragma GCC", "#define FD_")))


FORMATS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}  # fd::WeightFormat

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
{incs_a}}}
namespace B {{ {consts_b}
{incs_b}}}
}} }}
void run_kernel(int version, const fd::{args}& a) {{
  if (version) fd::FD_NS::B::{function}(a); else fd::FD_NS::A::{function}(a);
}}
"""

# Shared by both drivers: alternate A and B for `rounds` rounds of `calls(version)`, print the ratio.
TIMING = r"""
template <typename F>
void compare(F&& call, const std::vector<float>& out, int64_t rounds) {
  std::vector<float> first;
  call(0, 0);
  first = out;
  call(1, 0);
  double diff = 0;
  for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(out[i] - first[i])));
  std::vector<double> ratio, time_a, time_b;
  for (int64_t r = 0; r < rounds; ++r) {
    double t[2];
    for (int i = 0; i < 2; ++i) {
      const int version = r % 2 ? 1 - i : i;  // alternate which goes first
      const auto t0 = std::chrono::steady_clock::now();
      const int64_t calls = call(version, -1);
      t[version] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls;
    }
    ratio.push_back(t[1] / t[0]);
    time_a.push_back(t[0]);
    time_b.push_back(t[1]);
  }
  for (auto* x : {&ratio, &time_a, &time_b}) std::sort(x->begin(), x->end());
  const size_t n = ratio.size();
  std::printf("A %.1f us, B %.1f us per call (medians); B / A median %.3f, p10 %.3f, p90 %.3f; max |B - A| %.3g\n",
              time_a[n / 2] * 1e6, time_b[n / 2] * 1e6, ratio[n / 2], ratio[n / 10], ratio[n * 9 / 10], diff);
}
"""

HEADER = r"""#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <sys/mman.h>
#include "fd_kernels.h"
// Weights in transparent huge pages, as the engine packs them (fastdeploy/ops/quant.py, empty_packed).
static void* weight_memory(int64_t bytes) {
  const int64_t huge = 2 << 20, size = (bytes + huge - 1) / huge * huge;
  void* p = std::aligned_alloc(huge, size);
  madvise(p, size, MADV_HUGEPAGE);
  return p;
}
// Bytes of one packed [K, N] weight and floats of its scales (fastdeploy/ops/quant.py's layouts).
struct PackedSize {
  int64_t bytes, scales;
};
static PackedSize packed_size(int fmt, int64_t K, int64_t N) {
  const int64_t Np = (N + fd::kPanel - 1) / fd::kPanel;
  const int64_t block = fmt == fd::kInt8 ? fd::kActBlock : fmt == fd::kInt4 ? fd::kInt4Group : 1;
  const int64_t Kp = (K + block - 1) / block * block;
  return {fmt == fd::kFp32 ? Np * K * 64 : fmt == fd::kBf16 ? Np * K * 32 : Np * Kp * (fmt == fd::kInt8 ? 16 : 8),
          fmt == fd::kInt8 ? Np * 16 : fmt == fd::kInt4 ? Np * (Kp / fd::kInt4Group) * 16 : 0};
}
"""

ATTENTION_DRIVER = HEADER + "void run_kernel(int version, const fd::AttentionArgs& a);\n" + TIMING + r"""
int main(int argc, char** argv) {
  const int64_t ctx = atoll(argv[1]), T = atoll(argv[2]), H = atoll(argv[3]), KVH = atoll(argv[4]),
                D = atoll(argv[5]), layers = atoll(argv[6]), rounds = atoll(argv[7]), BS = 64;
  fd::set_active_isa(atoi(argv[8]));
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
  std::vector<float> q(T * H * D), k(T * row), v(T * row), out(T * H * D);
  for (auto& x : q) x = normal(rng);
  std::vector<int64_t> slots(T, -1), q_start{0, T}, ctx_lens{ctx};  // the new K/V are not written
  fd::AttentionArgs a{q.data(), k.data(), v.data(), caches[0].data(), slots.data(), q_start.data(),
                      ctx_lens.data(), blocks.data(), out.data(), T, 1, H, KVH, D, S, nb, BS, H * D, row,
                      1.0f / std::sqrt(static_cast<float>(D)), true, true};
  compare([&](int version, int64_t only) -> int64_t {
    for (int64_t l = only >= 0 ? only : 0; l < (only >= 0 ? only + 1 : layers); ++l) {
      a.cache = caches[l].data();
      run_kernel(version, a);
    }
    return only >= 0 ? 1 : layers;
  }, out, rounds);
}
"""

LINEAR_DRIVER = HEADER + "void run_kernel(int version, const fd::LinearArgs& a);\n" + TIMING + r"""
int main(int argc, char** argv) {
  const int64_t T = atoll(argv[1]), K = atoll(argv[2]), N = atoll(argv[3]), rounds = atoll(argv[5]);
  const int fmt = atoi(argv[4]);
  fd::set_active_isa(atoi(argv[6]));
  const auto [bytes, nscales] = packed_size(fmt, K, N);
  const int64_t copies = std::max<int64_t>(1, (atoll(argv[7]) << 20) / bytes);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> src(K * N), x(T * K), out(T * N);
  for (auto& v : src) v = normal(rng);
  for (auto& v : x) v = normal(rng);
  std::vector<void*> weights(copies);
  std::vector<std::vector<float>> scales(copies, std::vector<float>(nscales));
  for (int64_t c = 0; c < copies; ++c) {
    weights[c] = weight_memory(bytes);
    fd::active_kernels()->pack(fd::PackArgs{src.data(), fd::kSrcF32, K, N, N, 1, fmt, weights[c], scales[c].data(), N, 0});
  }
  std::printf("%lld copies of %.1f MB cycled\n", static_cast<long long>(copies), bytes / 1e6);
  compare([&](int version, int64_t only) -> int64_t {
    for (int64_t c = only >= 0 ? only : 0; c < (only >= 0 ? only + 1 : copies); ++c)
      run_kernel(version, fd::LinearArgs{x.data(), weights[c], scales[c].data(), out.data(), T, K, N, fmt});
    return only >= 0 ? 1 : copies;
  }, out, rounds);
}
"""

MOE_DRIVER = HEADER + "void run_kernel(int version, const fd::MoeArgs& a);\n" + TIMING + r"""
// E experts' packed weights, each its own memory: a different batch of tokens per call picks other experts,
// read from DRAM as in a model (E x an expert's bytes is far larger than the caches).
struct Stacked {
  uint8_t* data;
  std::vector<float> scales;
  fd::MoeWeight w;
};
static Stacked stacked(int64_t E, int64_t K, int64_t N, int fmt, std::mt19937& rng) {
  const auto [bytes, nscales] = packed_size(fmt, K, N);
  const int64_t ns = nscales > 0 ? nscales : 1;
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> src(K * N);
  for (auto& v : src) v = normal(rng);
  Stacked s{static_cast<uint8_t*>(weight_memory(E * bytes)), std::vector<float>(E * ns), {}};
  for (int64_t e = 0; e < E; ++e)
    fd::active_kernels()->pack(fd::PackArgs{src.data(), fd::kSrcF32, K, N, N, 1, fmt, s.data + e * bytes,
                                            s.scales.data() + e * ns, N, 0});
  s.w = fd::MoeWeight{s.data, s.scales.data(), bytes, ns, K, N, fmt};
  return s;
}
int main(int argc, char** argv) {
  const int64_t T = atoll(argv[1]), H = atoll(argv[2]), I = atoll(argv[3]), E = atoll(argv[4]), top_k = atoll(argv[5]),
                shared_i = atoll(argv[6]), rounds = atoll(argv[8]);
  const int fmt = atoi(argv[7]);
  fd::set_active_isa(atoi(argv[9]));
  constexpr int64_t kBatches = 16;
  std::mt19937 rng(0);
  Stacked router = stacked(1, H, E, fd::kFp32, rng), up_gate = stacked(E, H, 2 * I, fmt, rng),
          down = stacked(E, I, H, fmt, rng);
  Stacked su = shared_i ? stacked(1, H, 2 * shared_i, fmt, rng) : Stacked{},
          sd = shared_i ? stacked(1, shared_i, H, fmt, rng) : Stacked{};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(kBatches * T * H), out(T * H), weights(T * top_k);
  for (auto& v : x) v = normal(rng);
  std::vector<int64_t> ids(T * top_k);
  std::printf("%lld experts of %.1f MB\n", static_cast<long long>(E), (up_gate.w.w_stride + down.w.w_stride) / 1e6);
  fd::MoeArgs a{nullptr, router.w, nullptr, up_gate.w, down.w, su.w, sd.w, out.data(), ids.data(), weights.data(),
                T, H, E, E, 0, top_k, 1e-12f, true};
  compare([&](int version, int64_t only) -> int64_t {
    for (int64_t b = only >= 0 ? only : 0; b < (only >= 0 ? only + 1 : kBatches); ++b) {
      a.x = x.data() + b * T * H;
      run_kernel(version, a);
    }
    return only >= 0 ? 1 : kBatches;
  }, out, rounds);
}
"""


def isa_constants(unit: str) -> dict[str, str]:
    """The `constexpr int/bool kName = value` constants of custom_ops/isa_<unit>.cc, as written there."""
    text = (SOURCES / f"isa_{unit}.cc").read_text()
    found = {}
    for decl in re.findall(r"constexpr (?:int|bool) ([^;]+);", text):
        for item in decl.split(","):
            name, _, value = item.partition("=")
            found[name.strip()] = value.strip()
    return found


def constants(unit: str, overrides: list[str]) -> str:
    values = isa_constants(unit)
    for item in overrides:
        name, _, value = item.partition("=")
        if name not in values or not re.fullmatch(r"-?\d+|true|false", value):
            raise SystemExit(f"--a-const / --b-const take NAME=VALUE with NAME one of {sorted(values)}, got {item!r}")
        values[name] = value
    return " ".join(f"constexpr {'bool' if v in ('true', 'false') else 'int'} {k} = {v};" for k, v in values.items())


def kernel_file(name: str, rev: str | None, work: Path, tag: str) -> Path:
    """custom_ops/`name` of the worktree, or of git revision `rev` (written into `work`/`tag`, with the
    kern_*.inc files it includes from the same revision, which the compiler then finds beside it)."""
    if rev is None:
        return SOURCES / name
    folder = work / tag
    folder.mkdir(exist_ok=True)
    pending = [name]
    while pending:
        file = pending.pop()
        text = subprocess.run(["git", "show", f"{rev}:custom_ops/{file}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        (folder / file).write_text(text)
        pending += [f for f in re.findall(r'^#include "(kern_\w+\.inc)"', text, re.M) if not (folder / f).exists()]
    return folder / name


def includes(kernel: str, rev: str | None, work: Path, tag: str) -> str:
    """The #include lines of one version: the kernel's file, after kern_linear.inc for moe (which calls it)."""
    names = ["kern_linear.inc", "kern_moe.inc"] if kernel == "moe" else [f"kern_{kernel}.inc"]
    return "".join(f'#include "{kernel_file(name, rev, work, tag)}"\n' for name in names)


def label(rev: str | None, overrides: list[str]) -> str:
    return " ".join([rev or "worktree", *overrides])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", choices=["attention", "linear", "moe"])
    p.add_argument("--isa", choices=sorted(TARGETS), default="avx512")
    p.add_argument("--a-rev", help="git revision whose kernel file is A (default: the worktree's)")
    p.add_argument("--b-rev", help="the same for B")
    p.add_argument("--a-const", action="append", default=[], help="NAME=VALUE: a constant of A (repeatable)")
    p.add_argument("--b-const", action="append", default=[], help="the same for B")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--ctx", type=int, default=4096, help="attention: context positions (default 4096)")
    p.add_argument("--tokens", type=int, default=1, help="attention: new tokens, the last of the context")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=1, help="attention: caches cycled per round (default 1)")
    p.add_argument("--rows", type=int, default=1, help="linear: activation rows (default 1: a GEMV); moe: tokens")
    p.add_argument("--k", type=int, default=1024, help="linear: input features (default 1024)")
    p.add_argument("--n", type=int, default=6144, help="linear: output features (default 6144)")
    p.add_argument("--format", choices=list(FORMATS), default="int4", help="linear and moe: packed weight format")
    p.add_argument("--cycle-mb", type=int, default=256,
                   help="linear: copies of the weights cycled to make this many MB (default 256: every weight read "
                        "from DRAM; 0: one copy, in cache when it fits)")
    p.add_argument("--hidden", type=int, default=2560, help="moe: hidden size (default: ERNIE-4.5-21B-A3B's, as below)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--inter", type=int, default=1536, help="moe: an expert's intermediate size")
    p.add_argument("--shared-inter", type=int, default=3072, help="moe: the shared MLP's intermediate size (0: none)")
    args = p.parse_args()
    if args.kernel == "attention" and (args.tokens > args.ctx or args.heads % args.kv_heads or args.head_dim < 1):
        raise SystemExit("attention needs tokens <= ctx, heads a multiple of kv-heads and head-dim >= 1 (revisions "
                         "before 4b771a5 only take multiples of 16)")
    unit, level = TARGETS[args.isa]
    if args.kernel == "attention":
        shape = [args.ctx, args.tokens, args.heads, args.kv_heads, args.head_dim, args.layers, args.rounds, level]
        what = (f"ctx {args.ctx}, {args.tokens} new tokens, {args.heads} / {args.kv_heads} heads x {args.head_dim}, "
                f"{args.layers} layer(s) cycled")
        driver, arg_type = ATTENTION_DRIVER, "AttentionArgs"
    elif args.kernel == "moe":
        shape = [args.rows, args.hidden, args.inter, args.experts, args.top_k, args.shared_inter, FORMATS[args.format],
                 args.rounds, level]
        what = (f"{args.rows} tokens, hidden {args.hidden}, {args.experts} experts top-{args.top_k} x {args.inter}, "
                f"shared {args.shared_inter}, {args.format}")
        driver, arg_type = MOE_DRIVER, "MoeArgs"
    else:
        shape = [args.rows, args.k, args.n, FORMATS[args.format], args.rounds, level, args.cycle_mb]
        what = f"{args.rows} x {args.k} @ {args.k} x {args.n} {args.format}"
        driver, arg_type = LINEAR_DRIVER, "LinearArgs"
    with tempfile.TemporaryDirectory(prefix="kernel_ab-") as tmp:
        work = Path(tmp)
        (work / "kernels.cc").write_text(KERNELS.format(
            target=target_lines(unit), consts_a=constants(unit, args.a_const), consts_b=constants(unit, args.b_const),
            incs_a=includes(args.kernel, args.a_rev, work, "a"), incs_b=includes(args.kernel, args.b_rev, work, "b"),
            args=arg_type, function=args.kernel))
        (work / "driver.cc").write_text(driver)
        exe = work / "kernel_ab"
        sources = [work / "kernels.cc", work / "driver.cc"] + [SOURCES / f for f in
                                                                ("dispatch.cc", "embedding.cc", "isa_avx512.cc", "isa_avx2.cc")]
        subprocess.run(["g++", *CXX_FLAGS, f"-I{SOURCES}", *map(str, sources), *LD_FLAGS, "-o", str(exe)], check=True)
        print(f"{args.kernel} on {args.isa}: A = {label(args.a_rev, args.a_const)}, "
              f"B = {label(args.b_rev, args.b_const)}; {what}, {args.rounds} rounds")
        subprocess.run([str(exe), *map(str, shape)], check=True)


if __name__ == "__main__":
    main()
