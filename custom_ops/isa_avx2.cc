// The kernels compiled for AVX2 + FMA. Only called after CPUID says so (dispatch.cc).
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fd_kernels.h"

// Everything defined from here on may use these instructions; the Paddle bindings and dispatch.cc
// stay baseline x86-64.
#pragma GCC target("avx2,fma,f16c,bmi2")
// GCC 12 takes the builtins this target pragma enables for ones that may throw, so every intrinsic ends a
// basic block and some register blocks kept their accumulators on the stack, stored every k (the AVX2 fp32
// GEMM ran at half speed). Nothing here throws.
#pragma GCC optimize("no-exceptions")

#define FD_NS avx2
#include "fd_simd.h"

namespace fd {
namespace avx2 {

// Register blocking of the linear kernels (rows x 16-column panels), sized for 16 vector registers (a 16-lane value is two).
constexpr int kGemvPanels = 4;       // fp32 / bf16 GEMV: 8 FMA chains cover the FMA latency (int8 / int4: 1 panel)
constexpr int kGemvPrefetch = 4096;  // int4 GEMV software prefetch distance in bytes (kern_linear.inc)
constexpr int kDenseRows = 6, kDensePanels = 1;
constexpr int kInt8Rows = 2, kInt8Panels = 1;
constexpr int kAttnRows = 8;  // query rows per attention register block: a GQA group of 8 reads each key part once
constexpr int kAttnValueRows = 4;  // of those, rows per block of the weighted values (8 accumulators + 2 values)
constexpr int kAttnWidenBlocks = 3;  // widen bf16 K/V once per chunk from this many blocks (kern_attention.inc)
constexpr int kAttnRowsWide = 4;  // query rows per block in items of kAttnWidenBlocks blocks (prefill)
constexpr int kInt4Rows = 3, kInt4Panels = 1;  // Zen 3: 0.92-0.94x the time of 2 rows (16-512 rows); 4: 0.98x
constexpr int kWidenRows = 48;  // bf16 GEMMs of this many rows widen each panel once per work item (32: 1.05x the time)

#include "kern_elementwise.inc"
#include "kern_attention.inc"
#include "kern_linear.inc"
#include "kern_sampling.inc"
#include "kern_pack.inc"
#include "kern_moe.inc"

}  // namespace avx2

const KernelTable& avx2_kernels() {
  static const KernelTable table{"avx2", avx2::rms_norm, avx2::silu_mul, avx2::rotary, avx2::attention,
                                 avx2::linear, avx2::sample, avx2::argmax, avx2::pack, avx2::moe,
                                 avx2::quick_gelu};
  return table;
}

}  // namespace fd
