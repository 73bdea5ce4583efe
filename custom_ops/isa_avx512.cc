// The kernels compiled for AVX-512 (F, BW, VL, DQ, VNNI). Only called after CPUID says so (dispatch.cc).
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fd_kernels.h"

// Everything defined from here on may use these instructions; the Paddle bindings and dispatch.cc
// stay baseline x86-64.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")
// As in isa_avx2.cc: otherwise GCC 12 ends a basic block at every intrinsic (nothing here throws).
#pragma GCC optimize("no-exceptions")

#define FD_AVX512 1
#define FD_NS avx512
#include "fd_simd.h"

namespace fd {
namespace avx512 {

// Register blocking of the linear kernels (rows x 16-column panels), sized for 32 vector registers.
constexpr int kGemvPanels = 8;
constexpr int kGemvPrefetch = 0;  // int4 GEMV software prefetch: off (kern_linear.inc; 4 KB ahead measured 0.97-1.06x)
constexpr int kDenseRows = 6, kDensePanels = 4;
constexpr int kInt8Rows = 4, kInt8Panels = 2;  // 3 panels measured 1.03-1.19x slower (kernel_ab)
constexpr int kAttnRows = 8;  // query rows per attention register block
constexpr int kAttnValueRows = 4;  // of those, rows per block of the weighted values (16 accumulators)
constexpr int kAttnWidenBlocks = 8;  // widen bf16 K/V once per chunk from this many blocks (kern_attention.inc)
constexpr int kAttnRowsWide = 4;  // in wide items (prefill) too: 8 measured slower
constexpr int kInt4Rows = 4, kInt4Panels = 2;
constexpr int kWidenRows = 0;  // bf16 without the dot instruction: always widened in the kernel (not measured)

#include "kern_elementwise.inc"
#include "kern_attention.inc"
#include "kern_linear.inc"
#include "kern_sampling.inc"
#include "kern_pack.inc"
#include "kern_moe.inc"

}  // namespace avx512

const KernelTable& avx512_kernels() {
  static const KernelTable table{"avx512", avx512::rms_norm, avx512::silu_mul, avx512::rotary, avx512::attention,
                                 avx512::linear, avx512::sample, avx512::argmax, avx512::pack, avx512::moe,
                                 avx512::quick_gelu};
  return table;
}

}  // namespace fd
