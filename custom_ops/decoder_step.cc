// A whole forward step of the shared decoder (ERNIE-4.5 dense and MoE, Qwen2, Qwen3; one tensor-parallel
// rank) in one call, made from Python through ctypes (fastdeploy/model_executor/compiled_step.py).
//
// It runs the kernels of the layer-by-layer Paddle path (models/decoder.py) in the same order on the same
// inputs, so its logits and KV cache are the same bits; what it saves is the ~10 Paddle op dispatches
// and the Python around them per layer, which at one stream cost more than the weights' streaming does.
// ctypes releases the GIL for the call.
#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fd_kernels.h"

namespace fd {
namespace {

// Mirrors of the ctypes structures in compiled_step.py: keep the two in the same order.
struct StepLayer {
  const float* input_norm;
  const float* post_norm;
  MoeWeight qkv;
  const float* qkv_bias;  // nullptr: none (and likewise for every bias below)
  MoeWeight o;
  const float* o_bias;
  const float* q_norm;  // per-head RMSNorm weights [D] (Qwen3), or nullptr
  const float* k_norm;
  MoeWeight up_gate;  // dense MLP: [hidden, 2F] gate | up; w == nullptr for an MoE layer
  const float* up_gate_bias;
  MoeWeight down;
  const float* down_bias;
  MoeWeight router;  // MoE layer: router.w != nullptr
  const float* correction_bias;
  MoeWeight experts_up_gate, experts_down, shared_up_gate, shared_down;
  int64_t num_experts, expert_start, local_experts, top_k;
  float norm_min;
  int32_t renormalize;
  void* kv_cache;  // [2, blocks, KVH, block_size, row] as StepModel::cache_kind says (fd::CacheKind)
};

struct StepModel {
  const StepLayer* layers;
  int64_t num_layers, hidden, heads, kv_heads, head_dim, max_ffn, max_top_k, cache_slots, block_size;
  float eps, attn_scale;
  int32_t interleaved;
  MoeWeight embedding;  // the packed table [hidden, vocab]
  MoeWeight lm_head;    // [hidden, vocab]; the same bytes as embedding when tied
  const float* final_norm;
  const float* cos_table;  // [max_positions, D / 2]: row p is ops.rotary_cos_sin of position p
  const float* sin_table;
  int64_t max_positions;
  int32_t cache_kind;
  // ERNIE-4.5's MTP layer as the model (mtp_proj.w != nullptr): a step's input rows (StepBatch::input_hidden) are
  // the main model's final hidden states h, and its first layer's input is mtp_proj [2H, H] applied to
  // [rms(embedding(ids)) * mtp_emb_norm, rms(h) * mtp_hidden_norm].
  const float* mtp_emb_norm;
  const float* mtp_hidden_norm;
  MoeWeight mtp_proj;
};

struct StepBatch {
  const int64_t* ids;        // [T]
  const int64_t* positions;  // [T]: rotary positions
  const int64_t* q_lens;     // [B]: request b's new tokens are the last q_lens[b] of its ctx_lens[b]
  const int64_t* ctx_lens;   // [B]
  const int64_t* blocks;     // [B, max_blocks]
  const int64_t* logit_rows; // [R]
  float* logits;             // [R, vocab]
  int64_t T, B, max_blocks, R;
  int64_t* argmax;           // [R] or nullptr: also each logit row's token, taken while the logits are in cache:
                             // the sampling op's argmax, or with sample_params its draw
  const double* sample_params;  // [R, kSampleCols] (the sampling op's table) or nullptr: greedy argmax
  const int64_t* sample_lists;  // with sample_params: the sampling op's token_lists (3R + 1 CSR offsets, then
                                // the rows' banned, prompt and output ids), n_sample_lists int64 in all
  int64_t n_sample_lists;
  const int64_t* hidden_rows;  // [n_hidden]: rows whose final-normed hidden states go to `hidden` (MTP drafting)
  float* hidden;               // [n_hidden, hidden]
  int64_t n_hidden;
  const float* input_hidden;   // [T, hidden] or nullptr: the first layer's input rows instead of the ids' embedding;
                               // for an MTP model (StepModel::mtp_proj) the hidden states its input is made from
};

// Where a step's time goes (the benchmarks report the share outside the weight-streaming GEMMs). Keep in
// the order of PHASES in compiled_step.py.
enum Phase : int { kEmbed = 0, kNorm, kQkv, kRope, kAttention, kOut, kMlp, kActivation, kMoe, kHead, kPhases };

// Activation buffers of one model, grown to the largest step seen and kept (a fresh allocation per step
// would page-fault its way through megabytes at every prefill), and the time spent in each phase.
struct Workspace {
  float* data = nullptr;
  int64_t size = 0;
  double seconds[kPhases] = {};
  ~Workspace() { std::free(data); }
  float* reserve(int64_t floats) {
    if (floats > size) {
      std::free(data);
      size = (floats + 15) / 16 * 16;
      data = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(size) * sizeof(float)));
    }
    return data;
  }
};

// Carves consecutive 64-byte aligned pieces out of one buffer.
struct Carver {
  float* base;
  int64_t used = 0;
  float* take(int64_t floats) {
    float* p = base == nullptr ? nullptr : base + used;
    used += (floats + 15) / 16 * 16;
    return p;
  }
};

// Adds the time since the last mark to a phase.
struct Clock {
  double* seconds;
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  void mark(Phase p) {
    const auto now = std::chrono::steady_clock::now();
    seconds[p] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

void linear(const KernelTable& kt, const float* x, const MoeWeight& w, const float* bias, float* y, int64_t T) {
  kt.linear(LinearArgs{x, w.w, w.scales, y, T, w.K, w.N, w.fmt});
  if (bias != nullptr)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < w.N; ++n) y[t * w.N + n] += bias[n];
}

struct Buffers {
  float *resid, *x, *y, *qkv, *attn, *ug, *act, *cos, *sin, *rows_y, *rows_r, *moe_w, *joined;
  int64_t *moe_ids, *q_start, *slots;
  // The last layer's kept rows (kept_rows): each request's first kept row and first kept index, logit row r's
  // and hidden row h's index among them; no queries (B + 1 zeros) and no slots (-1s) for the attention calls
  // that only write / only read.
  int64_t *first, *kept_start, *logit_at, *hidden_at, *no_queries, *no_slots;
};

// Lays the buffers out in `base` (nullptr: only counts); returns the floats needed.
int64_t carve(const StepModel& m, int64_t T, int64_t B, int64_t R, int64_t n_hidden, float* base, Buffers* b) {
  const int64_t H = m.hidden, D = m.head_dim, QD = m.heads * D, KD = m.kv_heads * D;
  Carver c{base};
  b->resid = c.take(T * H);
  b->x = c.take(T * H);
  b->y = c.take(T * H);
  b->qkv = c.take(T * (QD + 2 * KD));
  b->attn = c.take(T * QD);
  b->ug = c.take(T * 2 * m.max_ffn);
  b->act = c.take(T * m.max_ffn);
  b->cos = c.take(T * D / 2);
  b->sin = c.take(T * D / 2);
  b->rows_y = c.take(R * H);
  b->rows_r = c.take(std::max(R, n_hidden) * H);  // the final norm's residual: logit rows', then hidden rows'
  b->moe_w = c.take(T * m.max_top_k);
  b->moe_ids = reinterpret_cast<int64_t*>(c.take(2 * T * m.max_top_k));
  b->q_start = reinterpret_cast<int64_t*>(c.take(2 * (B + 1)));
  b->slots = reinterpret_cast<int64_t*>(c.take(2 * T));
  b->first = reinterpret_cast<int64_t*>(c.take(2 * B));
  b->kept_start = reinterpret_cast<int64_t*>(c.take(2 * (B + 1)));
  b->logit_at = reinterpret_cast<int64_t*>(c.take(2 * R));
  b->hidden_at = reinterpret_cast<int64_t*>(c.take(2 * n_hidden));
  b->no_queries = reinterpret_cast<int64_t*>(c.take(2 * (B + 1)));
  b->no_slots = reinterpret_cast<int64_t*>(c.take(2 * T));
  b->joined = c.take(m.mtp_proj.w != nullptr ? T * 2 * H : 0);  // an MTP model's [embedding | hidden] rows
  return c.used;
}

// Why the last fd_decoder_step call on this thread returned 1 (fd_step_error).
thread_local char g_error[512];

bool fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  return false;
}

// A weight the step multiplies by: present, a known format (int formats with scales), [K, N] as expected.
bool check_weight(const MoeWeight& w, const char* name, int64_t layer, int64_t K, int64_t N) {
  if (w.w == nullptr) return fail("layer %lld: %s is missing", (long long)layer, name);
  if (w.fmt < kFp32 || w.fmt > kInt4 || ((w.fmt == kInt8 || w.fmt == kInt4) && w.scales == nullptr))
    return fail("layer %lld: %s has format %d without what it needs", (long long)layer, name, w.fmt);
  if (w.K != K || (N >= 0 && w.N != N) || w.N <= 0)
    return fail("layer %lld: %s is [%lld, %lld], expected [%lld, %lld]", (long long)layer, name, (long long)w.K,
                (long long)w.N, (long long)K, (long long)N);
  return true;
}

// The compiled step's shape contract on the model: every size the buffers (carve) and kernels are sized from
// agrees with every weight's. Checked at each call, before any work (a few comparisons per layer).
bool check_model(const StepModel& m) {
  const int64_t H = m.hidden, D = m.head_dim;
  if (m.layers == nullptr || m.num_layers < 1 || H < 1 || m.heads < 1 || m.kv_heads < 1 || m.heads % m.kv_heads)
    return fail("model: %lld layers, hidden %lld, %lld heads over %lld kv heads (need >= 1 each, heads a multiple "
                "of kv heads)", (long long)m.num_layers, (long long)H, (long long)m.heads, (long long)m.kv_heads);
  if (D < 2 || D % 2) return fail("model: head_dim %lld must be even and >= 2 (rotary pairs)", (long long)D);
  if (m.block_size < 1 || m.cache_slots < m.block_size || m.cache_slots % m.block_size)
    return fail("model: %lld cache slots in blocks of %lld", (long long)m.cache_slots, (long long)m.block_size);
  if (m.cache_kind < kCacheF32 || m.cache_kind > kCacheFp8) return fail("model: cache kind %d", m.cache_kind);
  if (m.max_positions < 1 || m.cos_table == nullptr || m.sin_table == nullptr || m.final_norm == nullptr)
    return fail("model: rotary tables or final norm missing");
  if (!check_weight(m.embedding, "the embedding", -1, H, -1) || !check_weight(m.lm_head, "the LM head", -1, H, -1))
    return false;
  if (m.mtp_proj.w != nullptr) {
    if (m.mtp_emb_norm == nullptr || m.mtp_hidden_norm == nullptr) return fail("model: an MTP norm is missing");
    if (!check_weight(m.mtp_proj, "the MTP projection", -1, 2 * H, H)) return false;
  }
  const int64_t QD = m.heads * D, KD = m.kv_heads * D;
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const StepLayer& L = m.layers[l];
    if (L.input_norm == nullptr || L.post_norm == nullptr || L.kv_cache == nullptr ||
        (L.q_norm == nullptr) != (L.k_norm == nullptr))
      return fail("layer %lld: a norm or the KV cache is missing", (long long)l);
    if (!check_weight(L.qkv, "qkv", l, H, QD + 2 * KD) || !check_weight(L.o, "o_proj", l, QD, H)) return false;
    if (L.router.w == nullptr) {  // dense MLP: its width sizes the ug / act buffers (max_ffn)
      const int64_t F = L.down.K;
      if (F < 1 || F > m.max_ffn) return fail("layer %lld: FFN %lld outside [1, %lld]", (long long)l, (long long)F,
                                              (long long)m.max_ffn);
      if (!check_weight(L.up_gate, "up_gate", l, H, 2 * F) || !check_weight(L.down, "down", l, F, H)) return false;
      continue;
    }
    const int64_t E = L.num_experts, I = L.experts_down.K;
    if (E < 1 || L.top_k < 1 || L.top_k > E || L.top_k > m.max_top_k || L.expert_start < 0 || L.local_experts < 1 ||
        L.expert_start + L.local_experts > E)
      return fail("layer %lld: top-%lld of %lld experts (%lld from %lld here; buffers for top-%lld)", (long long)l,
                  (long long)L.top_k, (long long)E, (long long)L.local_experts, (long long)L.expert_start,
                  (long long)m.max_top_k);
    if (!check_weight(L.router, "the router", l, H, E)) return false;
    if (L.router.fmt != kFp32 && L.router.fmt != kBf16) return fail("layer %lld: the router is not fp32 or bf16",
                                                                    (long long)l);
    if (I < 1 || !check_weight(L.experts_up_gate, "experts' up_gate", l, H, 2 * I) ||
        !check_weight(L.experts_down, "experts' down", l, I, H))
      return g_error[0] != '\0' ? false : fail("layer %lld: expert FFN %lld", (long long)l, (long long)I);
    if (L.shared_up_gate.w != nullptr &&
        (!check_weight(L.shared_down, "shared experts' down", l, L.shared_down.K, H) ||
         !check_weight(L.shared_up_gate, "shared experts' up_gate", l, H, 2 * L.shared_down.K)))
      return false;
  }
  return true;
}

// The token lists of an in-forward draw: offsets from 0 to the number of ids, never decreasing, ids in the vocab.
bool check_sample_lists(const StepModel& m, const StepBatch& s) {
  const int64_t heads = 3 * s.R + 1, V = m.lm_head.N;
  if (s.argmax == nullptr || s.sample_lists == nullptr || s.n_sample_lists < heads)
    return fail("batch: sampling needs the token list (%lld int64 for %lld rows, at least %lld)",
                (long long)s.n_sample_lists, (long long)s.R, (long long)heads);
  const int64_t* off = s.sample_lists;
  if (off[0] != 0 || off[3 * s.R] != s.n_sample_lists - heads)
    return fail("batch: token offsets must run from 0 to the number of ids (%lld)", (long long)(s.n_sample_lists - heads));
  for (int64_t i = 0; i < 3 * s.R; ++i)
    if (off[i] > off[i + 1]) return fail("batch: token offsets must not decrease");
  for (int64_t i = heads; i < s.n_sample_lists; ++i)
    if (off[i] < 0 || off[i] >= V) return fail("batch: token id %lld outside [0, %lld)", (long long)off[i], (long long)V);
  return true;
}

// The batch against the model: token ids, positions and logit rows in range, lengths that add up.
bool check_batch(const StepModel& m, const StepBatch& s) {
  if (s.T < 1 || s.B < 1 || s.R < 0 || s.max_blocks < 1 || s.ids == nullptr || s.positions == nullptr ||
      s.q_lens == nullptr || s.ctx_lens == nullptr || s.blocks == nullptr || (s.R > 0 && (s.logit_rows == nullptr ||
      s.logits == nullptr)))
    return fail("batch: %lld tokens, %lld requests, %lld logit rows, %lld blocks per table", (long long)s.T,
                (long long)s.B, (long long)s.R, (long long)s.max_blocks);
  if (m.mtp_proj.w != nullptr && s.input_hidden == nullptr)
    return fail("batch: an MTP model's step needs the hidden states its input is made from (input_hidden)");
  for (int64_t t = 0; t < s.T; ++t) {
    if (s.positions[t] < 0 || s.positions[t] >= m.max_positions)
      return fail("batch: position %lld outside [0, %lld)", (long long)s.positions[t], (long long)m.max_positions);
    if (s.ids[t] < 0 || s.ids[t] >= m.embedding.N)
      return fail("batch: token id %lld outside [0, %lld)", (long long)s.ids[t], (long long)m.embedding.N);
  }
  for (int64_t r = 0; r < s.R; ++r)
    if (s.logit_rows[r] < 0 || s.logit_rows[r] >= s.T)
      return fail("batch: logit row %lld outside [0, %lld)", (long long)s.logit_rows[r], (long long)s.T);
  if (s.n_hidden < 0 || (s.n_hidden > 0 && (s.hidden_rows == nullptr || s.hidden == nullptr)))
    return fail("batch: %lld hidden rows (need >= 0, and with any, their row indices and an output buffer)",
                (long long)s.n_hidden);
  for (int64_t h = 0; h < s.n_hidden; ++h)
    if (s.hidden_rows[h] < 0 || s.hidden_rows[h] >= s.T)
      return fail("batch: hidden row %lld outside [0, %lld)", (long long)s.hidden_rows[h], (long long)s.T);
  return s.sample_params == nullptr || check_sample_lists(m, s);
}

// Query starts and the cache slot of every new token (its context position through its request's block
// table); false when the lengths do not add up to T or a slot falls outside the cache.
bool cache_slots(const StepModel& m, const StepBatch& s, int64_t* q_start, int64_t* slots) {
  q_start[0] = 0;
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t q = s.q_lens[b], ctx = s.ctx_lens[b];
    if (q < 0 || ctx < q || ctx > s.max_blocks * m.block_size || q_start[b] + q > s.T)
      return fail("batch: request %lld has %lld new tokens of %lld in context (tables of %lld blocks)", (long long)b,
                  (long long)q, (long long)ctx, (long long)s.max_blocks);
    for (int64_t p = ctx - q; p < ctx; ++p) {
      const int64_t block = s.blocks[b * s.max_blocks + p / m.block_size];
      if (block < 0 || (block + 1) * m.block_size > m.cache_slots)
        return fail("batch: request %lld's block %lld is not a cache block", (long long)b, (long long)block);
      slots[q_start[b] + p - (ctx - q)] = block * m.block_size + p % m.block_size;
    }
    q_start[b + 1] = q_start[b] + q;
  }
  return q_start[s.B] == s.T || fail("batch: query lengths add up to %lld, not %lld", (long long)q_start[s.B],
                                     (long long)s.T);
}

// The rows the last layer carries past its K/V: per request, its new tokens from its first logit or hidden row
// on (a suffix, as attention's queries must be). No other row's output of the last layer is ever read, so for
// them only K/V are computed and written (llama.cpp likewise drops them there). Returns how many rows are kept.
int64_t kept_rows(const StepBatch& s, const Buffers& b) {
  const auto owner = [&](int64_t row) {  // the request whose new tokens hold the row
    return std::upper_bound(b.q_start, b.q_start + s.B + 1, row) - b.q_start - 1;
  };
  for (int64_t i = 0; i < s.B; ++i) b.first[i] = b.q_start[i + 1];
  for (int64_t r = 0; r < s.R; ++r) {
    int64_t& first = b.first[owner(s.logit_rows[r])];
    first = std::min(first, s.logit_rows[r]);
  }
  for (int64_t h = 0; h < s.n_hidden; ++h) {
    int64_t& first = b.first[owner(s.hidden_rows[h])];
    first = std::min(first, s.hidden_rows[h]);
  }
  b.kept_start[0] = 0;
  for (int64_t i = 0; i < s.B; ++i) b.kept_start[i + 1] = b.kept_start[i] + b.q_start[i + 1] - b.first[i];
  for (int64_t r = 0; r < s.R; ++r) {
    const int64_t i = owner(s.logit_rows[r]);
    b.logit_at[r] = b.kept_start[i] + s.logit_rows[r] - b.first[i];
  }
  for (int64_t h = 0; h < s.n_hidden; ++h) {
    const int64_t i = owner(s.hidden_rows[h]);
    b.hidden_at[h] = b.kept_start[i] + s.hidden_rows[h] - b.first[i];
  }
  return b.kept_start[s.B];
}

// q, k and v of every row (rotated, Qwen3's per-head norms applied) where the fused rows have them (row stride
// W), not split out.
void qkv_rope(const KernelTable& kt, const StepModel& m, const StepLayer& L, int64_t T, const Buffers& b,
              Clock& clock) {
  const int64_t D = m.head_dim, QD = m.heads * D, KD = m.kv_heads * D, W = QD + 2 * KD;
  linear(kt, b.x, L.qkv, L.qkv_bias, b.qkv, T);
  clock.mark(kQkv);
  float *q = b.qkv, *k = q + QD;
  if (L.q_norm != nullptr)
    for (int64_t t = 0; t < T; ++t) {  // per token: its heads' rows are consecutive only within its row
      kt.rms_norm(q + t * W, nullptr, L.q_norm, q + t * W, nullptr, m.heads, D, m.eps);
      kt.rms_norm(k + t * W, nullptr, L.k_norm, k + t * W, nullptr, m.kv_heads, D, m.eps);
    }
  kt.rotary(q, k, b.cos, b.sin, T, m.heads, m.kv_heads, D, W, W, m.interleaved != 0);
  clock.mark(kRope);
}

// Attention over the fused rows: T rows whose K/V go to `slots` (negative: not written), queries per request
// as q_start says, outputs into b.attn.
void attend(const KernelTable& kt, const StepModel& m, const StepLayer& L, const StepBatch& s, const Buffers& b,
            int64_t T, const int64_t* slots, const int64_t* q_start, Clock& clock) {
  const int64_t D = m.head_dim, QD = m.heads * D, KD = m.kv_heads * D, W = QD + 2 * KD;
  float *q = b.qkv, *k = q + QD, *v = k + KD;
  kt.attention(AttentionArgs{q, k, v, L.kv_cache, slots, q_start, s.ctx_lens, s.blocks, b.attn, T, s.B, m.heads,
                             m.kv_heads, D, m.cache_slots, s.max_blocks, m.block_size, W, W, m.attn_scale, true,
                             m.cache_kind});
  clock.mark(kAttention);
}

// The kept rows' qkv and residual moved to the front, in order (a kept row's index is at most its row).
void move_kept_rows(const StepModel& m, const StepBatch& s, const Buffers& b) {
  const int64_t H = m.hidden, W = (m.heads + 2 * m.kv_heads) * m.head_dim;
  for (int64_t i = 0; i < s.B; ++i)
    for (int64_t row = b.first[i]; row < b.q_start[i + 1]; ++row) {
      const int64_t at = b.kept_start[i] + row - b.first[i];
      std::memmove(b.qkv + at * W, b.qkv + row * W, W * sizeof(float));
      std::memmove(b.resid + at * H, b.resid + row * H, H * sizeof(float));
    }
}

void mlp_block(const KernelTable& kt, const StepLayer& L, int64_t T, int64_t H, const Buffers& b, Clock& clock) {
  if (L.router.w == nullptr) {
    const int64_t F = L.down.K;
    linear(kt, b.x, L.up_gate, L.up_gate_bias, b.ug, T);
    clock.mark(kMlp);
    kt.silu_mul(b.ug, b.act, T, F);
    clock.mark(kActivation);
    linear(kt, b.act, L.down, L.down_bias, b.y, T);
    clock.mark(kMlp);
    return;
  }
  MoeArgs a{};
  a.x = b.x;
  a.router = L.router;
  a.bias = L.correction_bias;
  a.up_gate = L.experts_up_gate;
  a.down = L.experts_down;
  a.shared_up_gate = L.shared_up_gate;
  a.shared_down = L.shared_down;
  a.out = b.y;
  a.ids = b.moe_ids;
  a.weights = b.moe_w;
  a.T = T;
  a.H = H;
  a.E = L.num_experts;
  a.E_local = L.local_experts;
  a.expert_start = L.expert_start;
  a.top_k = L.top_k;
  a.norm_min = L.norm_min;
  a.renormalize = L.renormalize != 0;
  kt.moe(a);
  clock.mark(kMoe);
}

}  // namespace
}  // namespace fd

// One model's activation buffers and phase timers, used by one fd_decoder_step call at a time.
extern "C" __attribute__((visibility("default"))) void* fd_step_workspace_new() { return new fd::Workspace(); }

extern "C" __attribute__((visibility("default"))) void fd_step_workspace_free(void* ws) {
  delete static_cast<fd::Workspace*>(ws);
}

// Why the last call on this thread returned 1.
extern "C" __attribute__((visibility("default"))) const char* fd_step_error() { return fd::g_error; }

// Returns 0 on success, 1 for arguments outside the step's contract (fd_step_error says which), 2 when no
// kernels can run here. Everything is checked before anything is written.
extern "C" __attribute__((visibility("default"))) int fd_decoder_step(const fd::StepModel* mp, const fd::StepBatch* sp,
                                                                      void* workspace) {
  using namespace fd;
  g_error[0] = '\0';
  if (mp == nullptr || sp == nullptr || workspace == nullptr) return fail("null model, batch or workspace"), 1;
  const StepModel& m = *mp;
  const StepBatch& s = *sp;
  const KernelTable* ktp = active_kernels();
  if (ktp == nullptr) return 2;
  const KernelTable& kt = *ktp;
  const int64_t T = s.T, H = m.hidden, half = m.head_dim / 2;
  if (!check_model(m) || !check_batch(m, s)) return 1;

  Workspace& ws = *static_cast<Workspace*>(workspace);
  Clock clock{ws.seconds};
  Buffers b{};
  const int64_t need = carve(m, T, s.B, s.R, s.n_hidden, nullptr, &b);
  carve(m, T, s.B, s.R, s.n_hidden, ws.reserve(need), &b);
  if (!cache_slots(m, s, b.q_start, b.slots)) return 1;
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(b.cos + t * half, m.cos_table + s.positions[t] * half, half * sizeof(float));
    std::memcpy(b.sin + t * half, m.sin_table + s.positions[t] * half, half * sizeof(float));
  }
  if (m.mtp_proj.w != nullptr) {  // the MTP layer's input: the projection of [normed embedding | normed h]
    packed_columns(m.embedding.w, m.embedding.scales, m.embedding.fmt, m.embedding.K, m.embedding.N, s.ids, T, b.x);
    kt.rms_norm(b.x, nullptr, m.mtp_emb_norm, b.x, nullptr, T, H, m.eps);
    kt.rms_norm(s.input_hidden, nullptr, m.mtp_hidden_norm, b.y, nullptr, T, H, m.eps);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(b.joined + t * 2 * H, b.x + t * H, H * sizeof(float));
      std::memcpy(b.joined + t * 2 * H + H, b.y + t * H, H * sizeof(float));
    }
    linear(kt, b.joined, m.mtp_proj, nullptr, b.resid, T);
  } else if (s.input_hidden != nullptr)
    std::memcpy(b.resid, s.input_hidden, T * H * sizeof(float));
  else
    packed_columns(m.embedding.w, m.embedding.scales, m.embedding.fmt, m.embedding.K, m.embedding.N, s.ids, T,
                   b.resid);
  clock.mark(kEmbed);
  const int64_t kept = kept_rows(s, b);
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const StepLayer& L = m.layers[l];
    // The residual add is folded into the next norm, as in the Paddle path.
    if (l == 0) kt.rms_norm(b.resid, nullptr, L.input_norm, b.x, nullptr, T, H, m.eps);
    else kt.rms_norm(b.y, b.resid, L.input_norm, b.x, b.resid, T, H, m.eps);
    clock.mark(kNorm);
    qkv_rope(kt, m, L, T, b, clock);
    // Rows this layer carries past its K/V: all but in the last layer.
    const int64_t rows = l + 1 < m.num_layers ? T : kept;
    if (rows == T) {
      attend(kt, m, L, s, b, T, b.slots, b.q_start, clock);
    } else {  // every row's K/V into the cache (no queries), then the kept rows' queries (writing nothing)
      std::fill(b.no_queries, b.no_queries + s.B + 1, 0);
      attend(kt, m, L, s, b, T, b.slots, b.no_queries, clock);
      if (rows == 0) break;
      move_kept_rows(m, s, b);
      std::fill(b.no_slots, b.no_slots + rows, -1);
      attend(kt, m, L, s, b, rows, b.no_slots, b.kept_start, clock);
    }
    linear(kt, b.attn, L.o, L.o_bias, b.y, rows);
    clock.mark(kOut);
    kt.rms_norm(b.y, b.resid, L.post_norm, b.x, b.resid, rows, H, m.eps);
    clock.mark(kNorm);
    mlp_block(kt, L, rows, H, b, clock);
  }
  // Only the rows that are handed back or need logits go through the final norm (a row's norm does not depend
  // on the others, so gathering them gives the bits the layer path's norm of every row does).
  if (s.n_hidden > 0) {
    for (int64_t h = 0; h < s.n_hidden; ++h) {
      const int64_t row = b.hidden_at[h];
      std::memcpy(s.hidden + h * H, b.y + row * H, H * sizeof(float));
      std::memcpy(b.rows_r + h * H, b.resid + row * H, H * sizeof(float));
    }
    kt.rms_norm(s.hidden, b.rows_r, m.final_norm, s.hidden, b.rows_r, s.n_hidden, H, m.eps);
    clock.mark(kNorm);
  }
  if (s.R == 0) return 0;
  for (int64_t r = 0; r < s.R; ++r) {
    const int64_t row = b.logit_at[r];  // its row among the last layer's (the step's row when all are kept)
    std::memcpy(b.rows_y + r * H, b.y + row * H, H * sizeof(float));
    std::memcpy(b.rows_r + r * H, b.resid + row * H, H * sizeof(float));
  }
  kt.rms_norm(b.rows_y, b.rows_r, m.final_norm, b.rows_y, b.rows_r, s.R, H, m.eps);
  kt.linear(LinearArgs{b.rows_y, m.lm_head.w, m.lm_head.scales, s.logits, s.R, m.lm_head.K, m.lm_head.N,
                       m.lm_head.fmt});
  // The rows' tokens, taken while the logits are still in cache: a plain argmax, or the sampling op's draw
  // (bans, penalties, filters) over the same table and token lists it takes.
  if (s.argmax != nullptr && s.sample_params == nullptr) {
    kt.argmax(s.logits, s.R, m.lm_head.N, s.argmax);
  } else if (s.argmax != nullptr) {
    float* tau = static_cast<float*>(scratch(7, s.R * sizeof(float)));  // unread: no logprobs here
    kt.sample(SampleArgs{s.logits, s.sample_lists + 3 * s.R + 1, s.sample_lists, s.sample_params, s.argmax, tau,
                         s.R, m.lm_head.N});
  }
  clock.mark(kHead);
  return 0;
}

// Copies the seconds spent in each phase since the last call into out[0 .. kPhases) and restarts them.
extern "C" __attribute__((visibility("default"))) int fd_step_phase_seconds(void* workspace, double* out) {
  if (workspace == nullptr || out == nullptr) return 1;
  double* seconds = static_cast<fd::Workspace*>(workspace)->seconds;
  for (int p = 0; p < fd::kPhases; ++p) {
    out[p] = seconds[p];
    seconds[p] = 0.0;
  }
  return 0;
}
