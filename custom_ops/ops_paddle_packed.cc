// Paddle op bindings of the ops over packed weights (linear, embedding, MoE): shape and format checks of
// each weight, then one call into the active kernel table. Errors raise as in ops_paddle.cc.
#include "ops_paddle.h"

namespace {

using namespace fd_ops;

// Checks a packed weight for x @ W with W [K, N] in format `fmt`; `stacked` >= 0: `stacked` such weights
// along a leading dimension (experts). Returns the kernels' view of it.
fd::MoeWeight check_packed(const paddle::Tensor& weight, const paddle::Tensor& scales, int fmt, int64_t K,
                           int64_t N, int64_t stacked, const char* name) {
  PD_CHECK(weight.is_cpu() && weight.is_contiguous(), name, " must be a contiguous CPU tensor");
  Shape ws = weight.shape();
  if (stacked >= 0) {
    PD_CHECK(!ws.empty() && ws[0] == stacked, name, " must stack ", stacked, " experts along its first dimension");
    ws.erase(ws.begin());
  }
  const int64_t Np = (N + fd::kPanel - 1) / fd::kPanel;
  PD_CHECK(N > 0 && !ws.empty() && ws[0] == Np, name, " holds ", ws.empty() ? 0 : ws[0], " panels, N = ", N,
           " needs ", Np);
  fd::MoeWeight w{weight.data(), nullptr, 0, 0, K, N, fmt};
  int64_t per_expert = 0;  // elements of one expert's data
  switch (fmt) {
    case fd::kFp32:
    case fd::kBf16:
      PD_CHECK(weight.dtype() == (fmt == fd::kFp32 ? paddle::DataType::FLOAT32 : paddle::DataType::BFLOAT16),
               name, ": dtype does not match the format");
      PD_CHECK(ws.size() == 3 && ws[1] == K && ws[2] == fd::kPanel, name, " must be [N/16, K, 16] with K = ", K);
      per_expert = Np * K * fd::kPanel;
      w.w_stride = per_expert * (fmt == fd::kFp32 ? 4 : 2);
      break;
    case fd::kInt8:
    case fd::kInt4: {
      const int64_t block = fmt == fd::kInt8 ? fd::kActBlock : fd::kInt4Group;
      const int64_t Kp = (K + block - 1) / block * block;
      const int64_t per_vec = fmt == fd::kInt8 ? 4 : 8;  // k per 64-byte vector of one panel
      PD_CHECK(weight.dtype() == paddle::DataType::UINT8, name, ": packed int8/int4 weights must be uint8");
      PD_CHECK(ws.size() == 4 && ws[1] == Kp / per_vec && ws[2] == fd::kPanel && ws[3] == 4, name, " must be [N/16, ",
               Kp / per_vec, ", 16, 4] for K = ", K);
      check_f32(scales, "scales");
      const int64_t expect = fmt == fd::kInt8 ? Np * fd::kPanel : Np * (Kp / fd::kInt4Group) * fd::kPanel;
      PD_CHECK(scales.numel() == expect * (stacked >= 0 ? stacked : 1), name, "'s scales must have ",
               expect * (stacked >= 0 ? stacked : 1), " elements");
      w.w_stride = Np * (Kp / per_vec) * fd::kPanel * 4;
      w.scales = scales.data<float>();
      w.s_stride = expect;
      break;
    }
    default:
      PD_CHECK(false, name, ": unknown weight format ", fmt);
  }
  return w;
}

std::vector<paddle::Tensor> Linear(const paddle::Tensor& x, const paddle::Tensor& weight, const paddle::Tensor& scales,
                                   int fmt, int64_t n) {
  check_f32(x, "x");
  const Shape xs = x.shape();
  PD_CHECK(xs.size() == 2, "x must be [T, K]");
  const int64_t T = xs[0], K = xs[1];
  check_packed(weight, scales, fmt, K, n, -1, "weight");
  auto y = paddle::empty({T, n}, paddle::DataType::FLOAT32, x.place());
  fd::LinearArgs a{x.data<float>(), weight.data(), fmt >= fd::kInt8 ? scales.data<float>() : nullptr,
                   y.data<float>(), T, K, n, fmt};
  if (T > 0) kernels().linear(a);
  return {y};
}

std::vector<Shape> LinearShape(const Shape& x, const Shape&, const Shape&, int, int64_t n) { return {{x[0], n}}; }
std::vector<paddle::DataType> LinearDtype(const paddle::DataType& x, const paddle::DataType&,
                                          const paddle::DataType&) {
  return {x};
}

// Rows of the embedding table held as the packed matrix W [k, n] (the LM head's layout): out [T, k].
std::vector<paddle::Tensor> Embedding(const paddle::Tensor& ids, const paddle::Tensor& weight,
                                      const paddle::Tensor& scales, int fmt, int64_t k, int64_t n) {
  const Index index(ids, "ids");
  PD_CHECK(weight.is_cpu() && weight.is_contiguous(), "weight must be a contiguous CPU tensor");
  PD_CHECK(weight.shape().size() >= 3 && weight.shape()[0] == (n + fd::kPanel - 1) / fd::kPanel,
           "weight must hold ceil(n / 16) panels");
  PD_CHECK(fmt >= fd::kFp32 && fmt <= fd::kInt4, "unknown weight format ", fmt);
  if (fmt >= fd::kInt8) check_f32(scales, "scales");
  for (int64_t t = 0; t < index.n; ++t) PD_CHECK(index.p[t] >= 0 && index.p[t] < n, "id ", index.p[t], " is not in [0, ", n, ")");
  auto out = paddle::empty({index.n, k}, paddle::DataType::FLOAT32, weight.place());
  fd::packed_columns(weight.data(), fmt >= fd::kInt8 ? scales.data<float>() : nullptr, fmt, k, n, index.p, index.n,
                     out.data<float>());
  return {out};
}

std::vector<Shape> EmbeddingShape(const Shape& ids, const Shape&, const Shape&, int, int64_t k, int64_t) {
  return {{ids[0], k}};
}
std::vector<paddle::DataType> EmbeddingDtype(const paddle::DataType&, const paddle::DataType&,
                                             const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}


// One MoE layer; see fd::MoeArgs. Stacked expert weights hold this rank's E_local experts, the global ids
// expert_start .. expert_start + E_local - 1. bias: [E] float32 or empty (none); shared_*: fmt -1 = none
// (their tensors are then ignored). Returns out [T, H], ids [T, top_k] int64, weights [T, top_k].
std::vector<paddle::Tensor> Moe(const paddle::Tensor& x, const paddle::Tensor& router, const paddle::Tensor& router_s,
                                const paddle::Tensor& bias, const paddle::Tensor& up_gate,
                                const paddle::Tensor& up_gate_s, const paddle::Tensor& down,
                                const paddle::Tensor& down_s, const paddle::Tensor& shared_up_gate,
                                const paddle::Tensor& shared_up_gate_s, const paddle::Tensor& shared_down,
                                const paddle::Tensor& shared_down_s, int top_k, int64_t num_experts,
                                int64_t expert_start, int64_t intermediate, int64_t shared_intermediate,
                                int router_fmt, int expert_fmt_up, int expert_fmt_down, int shared_fmt_up,
                                int shared_fmt_down, float norm_min, bool renormalize) {
  check_f32(x, "x");
  const Shape xs = x.shape();
  PD_CHECK(xs.size() == 2, "x must be [T, hidden]");
  const int64_t T = xs[0], H = xs[1], E = num_experts;
  PD_CHECK(E > 0 && top_k >= 1 && top_k <= E, "top_k must be in [1, num_experts = ", E, "], got ", top_k);
  PD_CHECK(router_fmt == fd::kFp32 || router_fmt == fd::kBf16, "the router must be fp32 or bf16");
  PD_CHECK(intermediate > 0, "intermediate must be > 0");
  const Shape us = up_gate.shape();
  PD_CHECK(!us.empty(), "up_gate must be stacked [E_local, ...]");
  const int64_t EL = us[0];
  PD_CHECK(EL >= 1 && expert_start >= 0 && expert_start + EL <= E, "experts ", expert_start, " .. ",
           expert_start + EL - 1, " are not within the ", E, " experts");
  fd::MoeArgs a{};
  a.x = x.data<float>();
  a.router = check_packed(router, router_s, router_fmt, H, E, -1, "router");
  a.bias = nullptr;
  if (bias.numel() > 0) {
    check_f32(bias, "correction_bias");
    PD_CHECK(bias.numel() == E, "correction_bias must have num_experts = ", E, " elements");
    a.bias = bias.data<float>();
  }
  a.up_gate = check_packed(up_gate, up_gate_s, expert_fmt_up, H, 2 * intermediate, EL, "up_gate");
  a.down = check_packed(down, down_s, expert_fmt_down, intermediate, H, EL, "down");
  a.shared_up_gate = fd::MoeWeight{};
  a.shared_down = fd::MoeWeight{};
  if (shared_fmt_up >= 0) {
    PD_CHECK(shared_intermediate > 0 && shared_fmt_down >= 0, "shared experts need both weights");
    a.shared_up_gate = check_packed(shared_up_gate, shared_up_gate_s, shared_fmt_up, H, 2 * shared_intermediate, -1,
                                    "shared_up_gate");
    a.shared_down = check_packed(shared_down, shared_down_s, shared_fmt_down, shared_intermediate, H, -1,
                                 "shared_down");
  }
  auto out = paddle::empty({T, H}, paddle::DataType::FLOAT32, x.place());
  auto ids = paddle::empty({T, top_k}, paddle::DataType::INT64, x.place());
  auto weights = paddle::empty({T, top_k}, paddle::DataType::FLOAT32, x.place());
  a.out = out.data<float>();
  a.ids = ids.data<int64_t>();
  a.weights = weights.data<float>();
  a.T = T;
  a.H = H;
  a.E = E;
  a.E_local = EL;
  a.expert_start = expert_start;
  a.top_k = top_k;
  a.norm_min = norm_min;
  a.renormalize = renormalize;
  if (T > 0) kernels().moe(a);
  return {out, ids, weights};
}

std::vector<Shape> MoeShape(const Shape& x, const Shape&, const Shape&, const Shape&, const Shape&, const Shape&,
                            const Shape&, const Shape&, const Shape&, const Shape&, const Shape&, const Shape&,
                            int top_k) {
  return {x, {x[0], top_k}, {x[0], top_k}};
}
std::vector<paddle::DataType> MoeDtype(const paddle::DataType& x, const paddle::DataType&, const paddle::DataType&,
                                       const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
                                       const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
                                       const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {x, paddle::DataType::INT64, x};
}

}  // namespace

PD_BUILD_OP(fd_linear)
    .Inputs({"x", "weight", "scales"})
    .Outputs({"y"})
    .Attrs({"fmt: int", "n: int64_t"})
    .SetKernelFn(PD_KERNEL(Linear))
    .SetInferShapeFn(PD_INFER_SHAPE(LinearShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(LinearDtype));

PD_BUILD_OP(fd_embedding)
    .Inputs({"ids", "weight", "scales"})
    .Outputs({"out"})
    .Attrs({"fmt: int", "k: int64_t", "n: int64_t"})
    .SetKernelFn(PD_KERNEL(Embedding))
    .SetInferShapeFn(PD_INFER_SHAPE(EmbeddingShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(EmbeddingDtype));

PD_BUILD_OP(fd_moe)
    .Inputs({"x", "router", "router_scales", "correction_bias", "up_gate", "up_gate_scales", "down", "down_scales",
             "shared_up_gate", "shared_up_gate_scales", "shared_down", "shared_down_scales"})
    .Outputs({"out", "ids", "weights"})
    .Attrs({"top_k: int", "num_experts: int64_t", "expert_start: int64_t", "intermediate: int64_t",
            "shared_intermediate: int64_t", "router_fmt: int", "up_gate_fmt: int", "down_fmt: int",
            "shared_up_gate_fmt: int", "shared_down_fmt: int", "norm_min: float", "renormalize: bool"})
    .SetKernelFn(PD_KERNEL(Moe))
    .SetInferShapeFn(PD_INFER_SHAPE(MoeShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MoeDtype));
