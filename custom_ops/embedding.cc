// Embedding lookup from a packed table: the table [vocab, hidden] is held as the LM head's packed
// matrix W [K = hidden, N = vocab] (layouts: README.md), so a tied model stores it once. Row `id` of
// the table is column `id` of W, dequantized exactly as the reference unpack does (q * scale in
// float32). A gather, memory-light: plain C++, no ISA-specific code.
#include <omp.h>

#include <cstring>

#include "fd_kernels.h"

namespace fd {

void packed_columns(const void* data, const float* scales, int fmt, int64_t K, int64_t N, const int64_t* ids,
                    int64_t T, float* out) {
  (void)N;
  const auto gather = [&](int64_t t) {
    const int64_t n = ids[t], p = n / kPanel, j = n % kPanel;
    float* row = out + t * K;
    if (fmt == kFp32 || fmt == kBf16) {
      const int64_t base = p * K * kPanel + j;
      for (int64_t k = 0; k < K; ++k) {
        if (fmt == kFp32) {
          row[k] = static_cast<const float*>(data)[base + k * kPanel];
        } else {
          const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(data)[base + k * kPanel]) << 16;
          std::memcpy(row + k, &bits, 4);
        }
      }
    } else if (fmt == kInt8) {
      const int64_t Kp = (K + kActBlock - 1) / kActBlock * kActBlock;
      const uint8_t* w = static_cast<const uint8_t*>(data) + p * (Kp / 4) * 64 + j * 4;
      const float s = scales[n];
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(w[(k / 4) * 64 + k % 4] - 128) * s;
    } else {
      const int64_t Kp = (K + kInt4Group - 1) / kInt4Group * kInt4Group, groups = Kp / kInt4Group;
      const uint8_t* w = static_cast<const uint8_t*>(data) + p * (Kp / 8) * 64 + j * 4;
      const float* s = scales + p * groups * kPanel + j;
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t byte = w[(k / 8) * 64 + (k % 8) % 4];
        const int q = ((k % 8) < 4 ? (byte & 15) : (byte >> 4)) - 8;
        row[k] = static_cast<float>(q) * s[(k / kInt4Group) * kPanel];
      }
    }
  };
  // Not an OpenMP `if` clause: a false one still sets up a team of one (kern_elementwise.inc, parallel_for).
  if (T * K <= (1 << 16)) {
    for (int64_t t = 0; t < T; ++t) gather(t);
    return;
  }
#pragma omp parallel for num_threads(num_threads()) schedule(static)
  for (int64_t t = 0; t < T; ++t) gather(t);
}

}  // namespace fd
