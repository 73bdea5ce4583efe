// Run-time choice of the kernel table (CPUID) and of the OpenMP thread count.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "fd_kernels.h"

namespace fd {
namespace {

int detect() {
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0). Each level asks for
  // every extension its unit's `#pragma GCC target` enables.
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
              __builtin_cpu_supports("bmi2");
  bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                __builtin_cpu_supports("avx512vnni");
  bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  return bf16 ? 3 : (avx512 ? 2 : (avx2 ? 1 : 0));
}

std::atomic<int> g_active{-1};
std::atomic<int> g_threads{0};

}  // namespace

int detected_isa() {
  static const int level = detect();
  return level;
}

int active_isa() {
  int level = g_active.load(std::memory_order_relaxed);
  return level < 0 ? detected_isa() : level;
}

void set_active_isa(int level) {
  int best = detected_isa();
  g_active.store(level < 0 || level > best ? best : level, std::memory_order_relaxed);
}

const KernelTable* active_kernels() {
  switch (active_isa()) {
    case 3:
    case 2: return &avx512_kernels();
    case 1: return &avx2_kernels();
    default: return nullptr;
  }
}

int num_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : omp_get_num_procs();
}

void set_num_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

void* scratch(int slot, int64_t bytes) {
  struct Buffer {
    void* p = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(p); }
  };
  constexpr int kSlots = 18;  // 0-7: other kernels; 8-13, 17: moe; 14-15: attention's calling thread; 16: linear items
  thread_local Buffer buffers[kSlots];
  Buffer& b = buffers[slot];
  if (b.size < bytes) {
    std::free(b.p);
    b.size = (bytes + 63) / 64 * 64;
    b.p = std::aligned_alloc(64, static_cast<size_t>(b.size));
  }
  return b.p;
}

namespace {
struct LogitDesc {
  const float* x;
  bool operator()(int32_t a, int32_t b) const { return x[a] > x[b] || (x[a] == x[b] && a < b); }
};
}  // namespace

void sort_by_logit_desc(int32_t* ids, int64_t n, const float* x) { std::sort(ids, ids + n, LogitDesc{x}); }

void nth_by_logit_desc(int32_t* ids, int64_t n, int64_t nth, const float* x) {
  std::nth_element(ids, ids + nth, ids + n, LogitDesc{x});
}

}  // namespace fd

// Weight packing, called from Python through ctypes (fastdeploy/ops/pack.py) rather than as a Paddle
// op: the source is a strided numpy view of a memory-mapped checkpoint, not a tensor. ctypes releases
// the GIL for the call. Returns 0 on success, 1 for bad arguments, 2 when no kernels can run here.
extern "C" __attribute__((visibility("default"))) int fd_pack_columns(
    const void* src, int src_dtype, int64_t K, int64_t ncols, int64_t stride_k, int64_t stride_n, int fmt,
    void* dst, float* scales, int64_t N, int64_t col0) {
  using namespace fd;
  if (src == nullptr || dst == nullptr || src_dtype < kSrcBf16 || src_dtype > kSrcF32 || fmt < kFp32 ||
      fmt > kInt4 || K <= 0 || ncols <= 0 || stride_k < 0 || stride_n < 0 || col0 < 0 || col0 + ncols > N ||
      ((fmt == kInt8 || fmt == kInt4) && scales == nullptr))
    return 1;
  const KernelTable* kt = active_kernels();
  if (kt == nullptr) return 2;
  kt->pack(PackArgs{src, src_dtype, K, ncols, stride_k, stride_n, fmt, dst, scales, N, col0});
  return 0;
}
