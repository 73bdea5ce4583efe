// What the Paddle op bindings (ops_paddle*.cc) share: the active kernel table and argument checks.
#pragma once
#include <cstdint>
#include <vector>

#include "fd_kernels.h"
#include "paddle/extension.h"

namespace fd_ops {

using Shape = std::vector<int64_t>;

inline const fd::KernelTable& kernels() {
  const fd::KernelTable* k = fd::active_kernels();
  PD_CHECK(k != nullptr, "this CPU has neither AVX2+FMA nor AVX-512: the compiled ops cannot run");
  return *k;
}

inline void check_f32(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.is_cpu(), name, " must be a CPU tensor");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, name, " must be float32");
  PD_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Index tensors may be int32 or int64; the kernels read int64.
struct Index {
  const int64_t* p = nullptr;
  std::vector<int64_t> copy;
  int64_t n = 0;
  Index(const paddle::Tensor& t, const char* name) {
    PD_CHECK(t.is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
    n = t.numel();
    if (t.dtype() == paddle::DataType::INT64) {
      p = t.data<int64_t>();
    } else {
      PD_CHECK(t.dtype() == paddle::DataType::INT32, name, " must be int32 or int64");
      const int32_t* src = t.data<int32_t>();
      copy.assign(src, src + n);
      p = copy.data();
    }
  }
};

}  // namespace fd_ops
