// Plain C++ interface between the Paddle op bindings (ops_paddle.cc) and the per-ISA kernels
// (isa_avx512.cc, isa_avx2.cc). Nothing here includes Paddle headers, so the kernel translation
// units compile in seconds. Packed weight layouts are described in custom_ops/README.md.
#pragma once

#include <cstdint>

namespace fd {

constexpr int kPanel = 16;       // output columns per packed weight panel
constexpr int kActBlock = 32;    // activations are quantized to int8 per row per 32 k
constexpr int kInt4Group = 128;  // int4 weight scales: one per 128 k per output column

enum WeightFormat : int { kFp32 = 0, kBf16 = 1, kInt8 = 2, kInt4 = 3 };
// The KV cache's rows: D float32, D bf16, or (block_wise_fp8) D float8 e4m3fn bytes then the row's float32
// scale (its largest |value| / 448), so D + 4 bytes.
enum CacheKind : int { kCacheF32 = 0, kCacheBf16 = 1, kCacheFp8 = 2 };
constexpr int64_t kFp8ScaleBytes = 4;
constexpr float kFp8Max = 448.0f;  // e4m3fn's largest finite value

struct AttentionArgs {
  const float* q;          // token t's H heads x D at q + t * q_stride
  const float* k;          // token t's KVH heads x D at k + t * kv_stride
  const float* v;          // the same at v + t * kv_stride
  void* cache;             // [2, S / block_size, KVH, block_size, row]: keys then values; rows as cache_kind says
  const int64_t* slots;    // [T]: where each new token's K/V goes (negative: not written)
  const int64_t* q_start;  // [B + 1]: request b owns tokens q_start[b] .. q_start[b + 1] - 1
  const int64_t* ctx_lens; // [B]: tokens in context including the new ones
  const int64_t* blocks;   // [B, max_blocks]
  float* out;              // [T, H * D]
  int64_t T, B, H, KVH, D, S, max_blocks, block_size;  // S: cache slots (blocks x block_size)
  int64_t q_stride, kv_stride;  // floats from one token's q (k, v) to the next's: H * D (KVH * D) when packed
  float scale;
  bool causal = true;  // false: every query attends to its request's whole context (a ViT's patches)
  int cache_kind = kCacheF32;
};

struct LinearArgs {
  const float* x;       // [T, K]
  const void* w;        // packed, see README.md
  const float* scales;  // int8: [Np * 16]; int4: [Np, Kp / 128, 16]; unused otherwise
  float* y;             // [T, N]
  int64_t T, K, N;
  int fmt;
};

// One packed weight, or E of them stacked (expert e's data starts e * w_stride bytes in, its scales
// e * s_stride floats in). w == nullptr: absent.
struct MoeWeight {
  const void* w;
  const float* scales;  // int8 / int4 only
  int64_t w_stride, s_stride;
  int64_t K, N;
  int fmt;
};

// One mixture-of-experts layer: softmax routing over E experts, top-k, this rank's experts
// expert_start .. expert_start + E_local - 1 (the others contribute nothing), plus the shared MLP.
struct MoeArgs {
  const float* x;          // [T, H]
  MoeWeight router;        // K = H, N = E; fp32 or bf16
  const float* bias;       // [E] added to probs for choosing only; nullptr: none
  MoeWeight up_gate;       // stacked [E_local]: K = H, N = 2I, columns gate | up
  MoeWeight down;          // stacked [E_local]: K = I, N = H
  MoeWeight shared_up_gate, shared_down;  // unstacked; w == nullptr: no shared experts
  float* out;              // [T, H]
  int64_t* ids;            // [T, top_k]: chosen global expert ids, best first
  float* weights;          // [T, top_k]: their routing weights
  int64_t T, H, E, E_local, expert_start, top_k;
  float norm_min;
  bool renormalize;        // false: weights are the chosen probs as they are
};

// Columns of SampleArgs::params, one row per logit row. float64 holds the float32 parameters and the
// integer top_k exactly.
enum SampleCol : int {
  kTemperature = 0, kTopP, kTopK, kMinP, kRepetition, kFrequency, kPresence,
  kUniform,  // the row's uniform draw in [0, 1)
  kGreedy,   // nonzero: argmax after bans and penalties, nothing else
  kSampleCols
};

struct SampleArgs {
  const float* logits;       // [B, V], read only
  const int64_t* token_ids;  // ids in [0, V)
  const int64_t* token_off;  // [3B + 1]: row r's banned ids are token_ids[off[3r] .. off[3r + 1]), then its
                             // prompt ids up to off[3r + 2], then its output ids up to off[3r + 3]
  const double* params;      // [B, kSampleCols]
  int64_t* out;              // [B]: the token; -1 for a sampled row whose largest logit is not finite
  float* tau;                // [B]: a sampled row kept the tokens with logit / temperature >= tau (-inf:
                             // all); NaN for greedy rows and rows without a finite largest logit
  int64_t B, V;
};

// Source element types of PackArgs.
enum PackSrcDtype : int { kSrcBf16 = 0, kSrcF16 = 1, kSrcF32 = 2 };

// Pack source columns [0, ncols) of a strided [K, ncols] matrix into destination columns
// [col0, col0 + ncols) of one packed weight (all its Kp rows, and their scales). Other columns of the
// destination are not written.
struct PackArgs {
  const void* src;           // element [k, c] at src + k * stride_k + c * stride_n (elements)
  int src_dtype;             // PackSrcDtype: raw bfloat16 bits (uint16), float16 or float32
  int64_t K, ncols, stride_k, stride_n;
  int fmt;                   // WeightFormat of the destination
  void* dst;                 // packed data of the destination (one expert's)
  float* scales;             // int8: [Np * 16]; int4: [Np, Kp / 128, 16]; unused otherwise
  int64_t N, col0;           // destination columns (Np = ceil(N / 16)); first column written
};

// One instruction set's implementations. Every function parallelises internally with OpenMP.
struct KernelTable {
  const char* name;
  void (*rms_norm)(const float* x, const float* residual, const float* weight, float* out, float* residual_out,
                   int64_t rows, int64_t n, float eps);
  void (*silu_mul)(const float* x, float* out, int64_t rows, int64_t f);
  void (*rotary)(float* q, float* k, const float* cos, const float* sin, int64_t T, int64_t H, int64_t KVH,
                 int64_t D, int64_t q_stride, int64_t k_stride, bool interleaved);  // strides as AttentionArgs'
  void (*attention)(const AttentionArgs& a);
  void (*linear)(const LinearArgs& a);
  void (*sample)(const SampleArgs& a);
  void (*argmax)(const float* logits, int64_t B, int64_t V, int64_t* out);  // numpy's, per row
  void (*pack)(const PackArgs& a);
  void (*moe)(const MoeArgs& a);
  void (*quick_gelu)(const float* x, float* out, int64_t n);
};

const KernelTable& avx512_kernels();
const KernelTable& avx2_kernels();

// ISA levels: 0 = none usable, 1 = AVX2 + FMA, 2 = AVX-512 (F, BW, VL, DQ, VNNI), 3 = that + AVX512_BF16
// (the same kernel table; the bf16 linear kernel then uses the bf16 dot-product instruction).
int detected_isa();
int active_isa();
void set_active_isa(int level);  // clamped to what the CPU supports; -1 = best available
const KernelTable* active_kernels();  // nullptr when no usable ISA
int num_threads();
void set_num_threads(int n);  // <= 0: one per available core

// Per-thread scratch memory (64-byte aligned, grows, never shrinks); `slot` tells apart buffers in use
// at the same time. Kept out of the ISA translation units so that no std:: template is instantiated
// under an AVX-512 target attribute and then shared with baseline code by the linker.
void* scratch(int slot, int64_t bytes);

// Token ids ordered by descending logit x[id] (ties: lower id first); the nth_ form only places the
// element of position `nth` (std::nth_element). Here for the same reason as scratch().
void sort_by_logit_desc(int32_t* ids, int64_t n, const float* x);
void nth_by_logit_desc(int32_t* ids, int64_t n, int64_t nth, const float* x);

// Embedding rows from a packed table W [K, N]: out[t, :] = W[:, ids[t]] dequantized (embedding.cc).
void packed_columns(const void* data, const float* scales, int fmt, int64_t K, int64_t N, const int64_t* ids,
                    int64_t T, float* out);

}  // namespace fd
