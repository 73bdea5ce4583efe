// Paddle custom-op bindings (those over packed weights: ops_paddle_packed.cc): argument checks, index
// conversion, then one call into the kernel table chosen at run time (dispatch.cc). Errors raise through
// PD_CHECK (OSError in Python; the wrappers in fastdeploy/ops turn them into ValueError).
#include "ops_paddle.h"

namespace {

using namespace fd_ops;

std::vector<paddle::Tensor> PagedAttention(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                                           paddle::Tensor& kv_cache, const paddle::Tensor& slot_mapping,
                                           const paddle::Tensor& query_start_loc, const paddle::Tensor& context_lens,
                                           const paddle::Tensor& block_tables, int block_size, float scale,
                                           bool causal) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  const paddle::DataType cache_dtype = kv_cache.dtype();
  PD_CHECK(cache_dtype == paddle::DataType::FLOAT32 || cache_dtype == paddle::DataType::BFLOAT16 ||
               cache_dtype == paddle::DataType::UINT8,
           "kv_cache must be float32, bfloat16 or uint8 (block_wise_fp8)");
  const int cache_kind = cache_dtype == paddle::DataType::BFLOAT16 ? fd::kCacheBf16
                         : cache_dtype == paddle::DataType::UINT8  ? fd::kCacheFp8
                                                                   : fd::kCacheF32;
  const Shape qs = q.shape(), ks = k.shape(), cs = kv_cache.shape(), bs = block_tables.shape();
  PD_CHECK(qs.size() == 3, "q must be [T, H, D]");
  PD_CHECK(ks.size() == 3 && ks[0] == qs[0] && ks[2] == qs[2], "k must be [T, KVH, D] with q's T and D");
  PD_CHECK(v.shape() == ks, "v must have k's shape");
  const int64_t T = qs[0], H = qs[1], D = qs[2], KVH = ks[1];
  PD_CHECK(KVH > 0 && H % KVH == 0, "num_heads (", H, ") must be a multiple of num_kv_heads (", KVH, ")");
  PD_CHECK(D > 0 && H > 0, "head_dim and num_heads must be > 0, got ", D, " and ", H);
  PD_CHECK(block_size > 0, "block_size must be > 0, got ", block_size);
  const int64_t row = cache_kind == fd::kCacheFp8 ? D + fd::kFp8ScaleBytes : D;
  PD_CHECK(cs.size() == 5 && cs[0] == 2 && cs[2] == KVH && cs[3] == block_size && cs[4] == row,
           "kv_cache must be [2, num_blocks, KVH, block_size, D] (D + 4 bytes per row when uint8)");
  PD_CHECK(bs.size() == 2, "block_tables must be [B, max_blocks]");
  const int64_t num_blocks = cs[1], S = num_blocks * block_size, B = bs[0], MB = bs[1];
  Index slots(slot_mapping, "slot_mapping"), qsl(query_start_loc, "query_start_loc");
  Index ctx(context_lens, "context_lens"), table(block_tables, "block_tables");
  PD_CHECK(slots.n == T, "slot_mapping must have T = ", T, " entries");
  PD_CHECK(qsl.n == B + 1 && ctx.n == B, "query_start_loc must be [B + 1] and context_lens [B], B = ", B);
  PD_CHECK(qsl.p[0] == 0 && qsl.p[B] == T, "query_start_loc must start at 0 and end at T = ", T);
  for (int64_t t = 0; t < T; ++t) PD_CHECK(slots.p[t] < S, "slot_mapping[", t, "] = ", slots.p[t], " >= ", S);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qlen = qsl.p[b + 1] - qsl.p[b], c = ctx.p[b];
    PD_CHECK(qlen >= 0 && qlen <= c, "request ", b, ": ", qlen, " new tokens but context_lens = ", c);
    PD_CHECK((c + block_size - 1) / block_size <= MB, "request ", b, ": context ", c, " exceeds block_tables");
    for (int64_t i = 0; qlen > 0 && i < (c + block_size - 1) / block_size; ++i) {
      const int64_t blk = table.p[b * MB + i];
      PD_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", b, ", ", i, "] = ", blk, " is not a cache block");
    }
  }
  auto out = paddle::empty({T, H * D}, paddle::DataType::FLOAT32, q.place());
  fd::AttentionArgs a{q.data<float>(), k.data<float>(), v.data<float>(), kv_cache.data(), slots.p, qsl.p,
                      ctx.p, table.p, out.data<float>(), T, B, H, KVH, D, S, MB, block_size, H * D, KVH * D, scale,
                      causal, cache_kind};
  if (T > 0) kernels().attention(a);
  return {out};
}

std::vector<Shape> PagedAttentionShape(const Shape& q, const Shape&, const Shape&, const Shape& cache, const Shape&,
                                       const Shape&, const Shape&, const Shape&) {
  return {cache, {q[0], q[1] * q[2]}};
}

std::vector<paddle::DataType> SameAsFirstTwo(const paddle::DataType& a, const paddle::DataType&,
                                             const paddle::DataType&, const paddle::DataType& c,
                                             const paddle::DataType&, const paddle::DataType&,
                                             const paddle::DataType&, const paddle::DataType&) {
  return {c, a};
}

void check_norm(const paddle::Tensor& x, const paddle::Tensor& weight) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  PD_CHECK(x.shape().size() >= 1 && weight.numel() == x.shape().back(),
           "weight must have x's last dimension (", x.shape().back(), ") elements");
}

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight, float eps) {
  check_norm(x, weight);
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  const int64_t n = x.shape().back();
  if (x.numel() > 0)
    kernels().rms_norm(x.data<float>(), nullptr, weight.data<float>(), out.data<float>(), nullptr, x.numel() / n, n, eps);
  return {out};
}

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x, const paddle::Tensor& residual,
                                       const paddle::Tensor& weight, float eps) {
  check_norm(x, weight);
  check_f32(residual, "residual");
  PD_CHECK(residual.shape() == x.shape(), "residual must have x's shape");
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  auto res_out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  const int64_t n = x.shape().back();
  if (x.numel() > 0)
    kernels().rms_norm(x.data<float>(), residual.data<float>(), weight.data<float>(), out.data<float>(),
                       res_out.data<float>(), x.numel() / n, n, eps);
  return {out, res_out};
}

std::vector<paddle::Tensor> SiluMul(const paddle::Tensor& x) {
  check_f32(x, "x");
  Shape s = x.shape();
  PD_CHECK(!s.empty() && s.back() % 2 == 0, "x's last dimension must be even (gate | up)");
  const int64_t f = s.back() / 2;
  s.back() = f;
  auto out = paddle::empty(s, paddle::DataType::FLOAT32, x.place());
  if (x.numel() > 0) kernels().silu_mul(x.data<float>(), out.data<float>(), x.numel() / (2 * f), f);
  return {out};
}

std::vector<paddle::Tensor> QuickGelu(const paddle::Tensor& x) {
  check_f32(x, "x");
  auto out = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  if (x.numel() > 0) kernels().quick_gelu(x.data<float>(), out.data<float>(), x.numel());
  return {out};
}

void Rotary(paddle::Tensor& q, paddle::Tensor& k, const paddle::Tensor& cos, const paddle::Tensor& sin,
            bool interleaved) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const Shape qs = q.shape(), ks = k.shape();
  PD_CHECK(qs.size() == 3 && ks.size() == 3 && ks[0] == qs[0] && ks[2] == qs[2],
           "q must be [T, H, D] and k [T, KVH, D]");
  const int64_t T = qs[0], D = qs[2];
  PD_CHECK(D % 2 == 0, "head_dim must be even");
  PD_CHECK(cos.numel() == T * D / 2 && sin.numel() == T * D / 2, "cos and sin must be [T, head_dim / 2]");
  if (T > 0)
    kernels().rotary(q.data<float>(), k.data<float>(), cos.data<float>(), sin.data<float>(), T, qs[1], ks[1], D,
                     qs[1] * D, ks[1] * D, interleaved);
}

std::vector<Shape> RotaryShape(const Shape& q, const Shape& k, const Shape&, const Shape&) { return {q, k}; }
std::vector<paddle::DataType> RotaryDtype(const paddle::DataType& q, const paddle::DataType& k,
                                          const paddle::DataType&, const paddle::DataType&) {
  return {q, k};
}

// One token per logit row, and the row's filter threshold; see fd::SampleArgs. token_lists: int64, the
// 3B + 1 CSR offsets (into the ids that follow them) then the ids; params: float64 [B, kSampleCols].
std::vector<paddle::Tensor> Sample(const paddle::Tensor& logits, const paddle::Tensor& token_lists,
                                   const paddle::Tensor& params) {
  check_f32(logits, "logits");
  const Shape ls = logits.shape();
  PD_CHECK(ls.size() == 2 && ls[1] > 0, "logits must be [batch, vocab] with vocab > 0");
  const int64_t B = ls[0], V = ls[1];
  PD_CHECK(V < (int64_t{1} << 31) - 16, "vocab too large: token ids are held as int32");
  PD_CHECK(params.is_cpu() && params.is_contiguous() && params.dtype() == paddle::DataType::FLOAT64,
           "params must be a contiguous float64 CPU tensor");
  PD_CHECK(params.numel() == B * fd::kSampleCols, "params must be [", B, ", ", int(fd::kSampleCols), "]");
  Index tok(token_lists, "token_lists");
  PD_CHECK(tok.n >= 3 * B + 1, "token_lists must start with 3 * batch + 1 offsets");
  const int64_t* off = tok.p;
  const int64_t* ids = tok.p + 3 * B + 1;
  const int64_t n_ids = tok.n - (3 * B + 1);
  PD_CHECK(off[0] == 0 && off[3 * B] == n_ids, "token offsets must run from 0 to the number of ids");
  for (int64_t i = 0; i < 3 * B; ++i) PD_CHECK(off[i] <= off[i + 1], "token offsets must not decrease");
  for (int64_t i = 0; i < n_ids; ++i)
    PD_CHECK(ids[i] >= 0 && ids[i] < V, "token id ", ids[i], " is outside [0, ", V, ")");
  auto out = paddle::empty({B}, paddle::DataType::INT64, logits.place());
  auto tau = paddle::empty({B}, paddle::DataType::FLOAT32, logits.place());
  fd::SampleArgs a{logits.data<float>(), ids, off, params.data<double>(), out.data<int64_t>(), tau.data<float>(),
                   B, V};
  if (B > 0) kernels().sample(a);
  return {out, tau};
}

std::vector<Shape> SampleShape(const Shape& logits, const Shape&, const Shape&) { return {{logits[0]}, {logits[0]}}; }
std::vector<paddle::DataType> SampleDtype(const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::INT64, paddle::DataType::FLOAT32};
}

// Reads (and optionally changes) the run-time configuration: isa -2 = keep, -1 = best, 0..3 = that level
// (clamped to the CPU's); threads -1 = keep, 0 = one per core. Returns [detected, active, threads].
std::vector<paddle::Tensor> Runtime(const paddle::Tensor& x, int isa, int threads) {
  if (isa >= -1) fd::set_active_isa(isa);
  if (threads >= 0) fd::set_num_threads(threads);
  auto out = paddle::empty({3}, paddle::DataType::INT32, x.place());
  int32_t* p = out.data<int32_t>();
  p[0] = fd::detected_isa();
  p[1] = fd::active_isa();
  p[2] = fd::num_threads();
  return {out};
}

std::vector<Shape> RuntimeShape(const Shape&) { return {{3}}; }
std::vector<paddle::DataType> RuntimeDtype(const paddle::DataType&) { return {paddle::DataType::INT32}; }

std::vector<Shape> SameShape3(const Shape& x, const Shape&, const Shape&) { return {x, x}; }
std::vector<Shape> SameShape1(const Shape& x) { return {x}; }
std::vector<Shape> SameShape2(const Shape& x, const Shape&) { return {x}; }
std::vector<Shape> HalfLastShape(const Shape& x) {
  Shape s = x;
  s.back() /= 2;
  return {s};
}

}  // namespace

PD_BUILD_OP(fd_paged_attention)
    .Inputs({"q", "k", "v", "kv_cache", "slot_mapping", "query_start_loc", "context_lens", "block_tables"})
    .Outputs({"kv_cache_out", "out"})
    .Attrs({"block_size: int", "scale: float", "causal: bool"})
    .SetInplaceMap({{"kv_cache", "kv_cache_out"}})
    .SetKernelFn(PD_KERNEL(PagedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PagedAttentionShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SameAsFirstTwo));
PD_BUILD_OP(fd_rms_norm)
    .Inputs({"x", "weight"})
    .Outputs({"out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(SameShape2));
PD_BUILD_OP(fd_add_rms_norm)
    .Inputs({"x", "residual", "weight"})
    .Outputs({"out", "residual_out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(SameShape3));
PD_BUILD_OP(fd_silu_mul)
    .Inputs({"x"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(SiluMul))
    .SetInferShapeFn(PD_INFER_SHAPE(HalfLastShape));
PD_BUILD_OP(fd_quick_gelu)
    .Inputs({"x"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(QuickGelu))
    .SetInferShapeFn(PD_INFER_SHAPE(SameShape1));
PD_BUILD_OP(fd_rotary)
    .Inputs({"q", "k", "cos", "sin"})
    .Outputs({"q_out", "k_out"})
    .Attrs({"interleaved: bool"})
    .SetInplaceMap({{"q", "q_out"}, {"k", "k_out"}})
    .SetKernelFn(PD_KERNEL(Rotary))
    .SetInferShapeFn(PD_INFER_SHAPE(RotaryShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RotaryDtype));
PD_BUILD_OP(fd_sample)
    .Inputs({"logits", "token_lists", "params"})
    .Outputs({"tokens", "thresholds"})
    .SetKernelFn(PD_KERNEL(Sample))
    .SetInferShapeFn(PD_INFER_SHAPE(SampleShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SampleDtype));
PD_BUILD_OP(fd_runtime)
    .Inputs({"x"})
    .Outputs({"out"})
    .Attrs({"isa: int", "threads: int"})
    .SetKernelFn(PD_KERNEL(Runtime))
    .SetInferShapeFn(PD_INFER_SHAPE(RuntimeShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RuntimeDtype));
