// A 16-lane vector vocabulary shared by the kernels, implemented once for AVX-512 and once for AVX2.
//
// Included by isa_avx512.cc (FD_AVX512 defined) and isa_avx2.cc after their `#pragma GCC target`, so
// the same kernel source compiles to both instruction sets; FD_NS names the per-ISA namespace so the
// two definitions of VF never meet at link time. On AVX2 a 16-lane value is a pair of ymm
// registers. Every lane-wise operation rounds exactly as the scalar operation would (no implicit FMA:
// the build passes -ffp-contract=off), so the two builds give the same bits for the same inputs.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define FD_INLINE static inline __attribute__((always_inline))

#ifndef FD_NS
#error "define FD_NS (the per-ISA namespace) before including fd_simd.h"
#endif

namespace fd {
namespace FD_NS {

#if defined(FD_AVX512)

struct VF { __m512 v; };   // 16 x float32
struct VI { __m512i v; };  // 16 x int32

FD_INLINE VF vzero() { return {_mm512_setzero_ps()}; }
FD_INLINE VF vset1(float x) { return {_mm512_set1_ps(x)}; }
FD_INLINE VF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
FD_INLINE void vstore(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
FD_INLINE VF vload_n(const float* p, int n) { return {_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p)}; }
FD_INLINE void vstore_n(float* p, VF a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a.v); }
// 16 bfloat16 (stored as uint16) widened to float32: exact.
FD_INLINE VF vload_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
// 16 bf16 widened in whatever lane order is cheapest here; vunshuffle_bf16 restores column order (for
// lane-wise accumulators, once per output vector). Here: already in order.
FD_INLINE VF vload_bf16_shuffled(const uint16_t* p) { return vload_bf16(p); }
FD_INLINE VF vunshuffle_bf16(VF a) { return a; }
// Lane-wise bf16_rounded_bits (kern_elementwise.inc): rounded to bf16, nearest even, as fp32; zeros and
// denormals to signed zero, NaN quiet.
FD_INLINE VF vround_bf16(VF x) {
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), high = _mm512_set1_epi32(-65536);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), high);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7F800000)),
                            _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), high));
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(0x00800000)),
                            _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  return {_mm512_castsi512_ps(r)};
}
// The 16 lanes' upper halves (the bf16 of a rounded value) as 16 consecutive uint16.
FD_INLINE void vstore_bf16_upper(uint16_t* p, VF x) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x.v), 16)));
}
FD_INLINE VF vadd(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
FD_INLINE VF vsub(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
FD_INLINE VF vmul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
FD_INLINE VF vdiv(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
FD_INLINE VF vmax(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }
FD_INLINE VF vmin(VF a, VF b) { return {_mm512_min_ps(a.v, b.v)}; }
FD_INLINE VF vfma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
FD_INLINE VF vabs(VF a) { return {_mm512_abs_ps(a.v)}; }
FD_INLINE float vreduce_add(VF a) { return _mm512_reduce_add_ps(a.v); }
FD_INLINE float vreduce_max(VF a) { return _mm512_reduce_max_ps(a.v); }
FD_INLINE VF vround(VF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// Lanes >= n set to -inf (n in 0..16).
FD_INLINE VF vmask_tail_neginf(VF a, int n) {
  return {_mm512_mask_blend_ps((__mmask16)((1u << n) - 1), _mm512_set1_ps(-__builtin_inff()), a.v)};
}
// Lanes < n zeroed.
FD_INLINE VF vmask_zero_below(VF a, int n) {
  return {_mm512_maskz_mov_ps((__mmask16)(0xFFFFu << n), a.v)};
}
// [x0 x1 x2 x3 ...] -> [x1 x0 x3 x2 ...]: the partner of each interleaved rotary pair.
FD_INLINE VF vswap_pairs(VF a) { return {_mm512_permute_ps(a.v, 0xB1)}; }
// 2^n for integral n, times p (exact when the result is a normal float).
FD_INLINE VF vldexp(VF p, VF n) { return {_mm512_scalef_ps(p.v, n.v)}; }
FD_INLINE VF vselect_lt(VF a, float limit, VF if_lt, VF otherwise) {
  __mmask16 m = _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(limit), _CMP_LT_OQ);
  return {_mm512_mask_blend_ps(m, otherwise.v, if_lt.v)};
}

// Sums of 16 vectors: lane i of the result = sum of the lanes of a[i].
FD_INLINE VF vhsum16(const VF* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    __m512 x = a[2 * i].v, y = a[2 * i + 1].v;
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  }
  return {_mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD))};
}

// The native register, for attention's dot products (kern_attention.inc): here VF itself, and the sums of
// kLanesN of them are vhsum16's.
using VN = VF;
constexpr int kLanesN = 16;
FD_INLINE VN nzero() { return vzero(); }
FD_INLINE VN nset1(float x) { return vset1(x); }
FD_INLINE VN nload(const float* p) { return vload(p); }
FD_INLINE void nstore(float* p, VN a) { vstore(p, a); }
FD_INLINE VN nmul(VN a, VN b) { return vmul(a, b); }
FD_INLINE VN nfma(VN a, VN b, VN c) { return vfma(a, b, c); }
FD_INLINE VN nhsum(const VN* a) { return vhsum16(a); }
// Attention keeps its fp32 rows (queries, widened keys and values, running outputs) in a lane order that
// bf16 rows load into cheaply: here the natural one, one native register per 16 columns.
constexpr bool kLanesNatural = true;
constexpr int kPartsN = 1;
FD_INLINE VN nload_bf16_part(const uint16_t* p, int) { return vload_bf16(p); }
FD_INLINE VF vto_lanes(VF a) { return a; }
FD_INLINE VF vfrom_lanes(VF a) { return a; }

FD_INLINE VI izero() { return {_mm512_setzero_si512()}; }
FD_INLINE VI iset1(int32_t x) { return {_mm512_set1_epi32(x)}; }
FD_INLINE VF itof(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
FD_INLINE VI iabs(VI a) { return {_mm512_abs_epi32(a.v)}; }
// Round to nearest even, saturating is not needed: callers keep |x| <= 127.
FD_INLINE VI ftoi(VF a) { return {_mm512_cvtps_epi32(a.v)}; }
FD_INLINE int32_t ireduce_add(VI a) { return _mm512_reduce_add_epi32(a.v); }

#else  // AVX2 + FMA

struct VF { __m256 lo, hi; };
struct VI { __m256i lo, hi; };

FD_INLINE VF vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
FD_INLINE VF vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
FD_INLINE VF vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
FD_INLINE void vstore(float* p, VF a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
FD_INLINE VF vload_n(const float* p, int n) {
  alignas(32) float t[16] = {0};
  std::memcpy(t, p, sizeof(float) * n);
  return vload(t);
}
FD_INLINE void vstore_n(float* p, VF a, int n) {
  alignas(32) float t[16];
  vstore(t, a);
  std::memcpy(p, t, sizeof(float) * n);
}
FD_INLINE __m256 bf16x8(__m128i w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
}
FD_INLINE VF vload_bf16(const uint16_t* p) {
  return {bf16x8(_mm_loadu_si128((const __m128i*)p)), bf16x8(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
// 16 bf16 widened with one load and two ALU ops (vload_bf16 takes two loads and four): lo holds columns
// 0, 2, .., 14 and hi columns 1, 3, .., 15; vunshuffle_bf16 puts lane-wise results back in column order.
FD_INLINE VF vload_bf16_shuffled(const uint16_t* p) {
  const __m256i w = _mm256_loadu_si256((const __m256i*)p);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
FD_INLINE VF vunshuffle_bf16(VF a) {
  const __m256 even_odd_lo = _mm256_unpacklo_ps(a.lo, a.hi), even_odd_hi = _mm256_unpackhi_ps(a.lo, a.hi);
  return {_mm256_permute2f128_ps(even_odd_lo, even_odd_hi, 0x20), _mm256_permute2f128_ps(even_odd_lo, even_odd_hi, 0x31)};
}
// Lane-wise bf16_rounded_bits (kern_elementwise.inc): rounded to bf16, nearest even, as fp32; zeros and
// denormals to signed zero, NaN quiet.
FD_INLINE __m256 round_bf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), high = _mm256_set1_epi32(-65536);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), high);
  r = _mm256_blendv_epi8(r, _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), high),
                         _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000)));
  r = _mm256_blendv_epi8(r, _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u))),
                         _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), mag));
  return _mm256_castsi256_ps(r);
}
FD_INLINE VF vround_bf16(VF x) { return {round_bf16x8(x.lo), round_bf16x8(x.hi)}; }
// The 16 lanes' upper halves (the bf16 of a rounded value) as 16 consecutive uint16.
FD_INLINE void vstore_bf16_upper(uint16_t* p, VF x) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(x.lo), 16),
                                             _mm256_srli_epi32(_mm256_castps_si256(x.hi), 16));
  _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xD8));
}
#define FD_F2(op) {op(a.lo, b.lo), op(a.hi, b.hi)}
FD_INLINE VF vadd(VF a, VF b) { return FD_F2(_mm256_add_ps); }
FD_INLINE VF vsub(VF a, VF b) { return FD_F2(_mm256_sub_ps); }
FD_INLINE VF vmul(VF a, VF b) { return FD_F2(_mm256_mul_ps); }
FD_INLINE VF vdiv(VF a, VF b) { return FD_F2(_mm256_div_ps); }
FD_INLINE VF vmax(VF a, VF b) { return FD_F2(_mm256_max_ps); }
FD_INLINE VF vmin(VF a, VF b) { return FD_F2(_mm256_min_ps); }
#undef FD_F2
FD_INLINE VF vfma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
FD_INLINE VF vabs(VF a) {
  __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
FD_INLINE float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
FD_INLINE float vreduce_add(VF a) {
  __m256 s = _mm256_add_ps(a.lo, a.hi);
  return hsum8(s);
}
FD_INLINE float vreduce_max(VF a) {
  __m256 s = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
FD_INLINE VF vround(VF a) {
  const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
FD_INLINE __m256 lane_mask8(int n) {  // lanes < n all-ones
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}
FD_INLINE VF vmask_tail_neginf(VF a, int n) {
  __m256 ninf = _mm256_set1_ps(-__builtin_inff());
  return {_mm256_blendv_ps(ninf, a.lo, lane_mask8(n)), _mm256_blendv_ps(ninf, a.hi, lane_mask8(n - 8))};
}
FD_INLINE VF vmask_zero_below(VF a, int n) {
  return {_mm256_andnot_ps(lane_mask8(n), a.lo), _mm256_andnot_ps(lane_mask8(n - 8), a.hi)};
}
FD_INLINE VF vswap_pairs(VF a) { return {_mm256_permute_ps(a.lo, 0xB1), _mm256_permute_ps(a.hi, 0xB1)}; }
FD_INLINE __m256 ldexp8(__m256 p, __m256 n) {
  // n is integral and within [-126, 127] here (callers clamp), so 2^n is built from its exponent bits.
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
FD_INLINE VF vldexp(VF p, VF n) { return {ldexp8(p.lo, n.lo), ldexp8(p.hi, n.hi)}; }
FD_INLINE VF vselect_lt(VF a, float limit, VF if_lt, VF otherwise) {
  __m256 l = _mm256_set1_ps(limit);
  return {_mm256_blendv_ps(otherwise.lo, if_lt.lo, _mm256_cmp_ps(a.lo, l, _CMP_LT_OQ)),
          _mm256_blendv_ps(otherwise.hi, if_lt.hi, _mm256_cmp_ps(a.hi, l, _CMP_LT_OQ))};
}
FD_INLINE __m256 hsum8x8(const __m256* t) {
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(t[4], t[5]), _mm256_hadd_ps(t[6], t[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
FD_INLINE VF vhsum16(const VF* a) {
  __m256 t[16];
  for (int i = 0; i < 16; ++i) t[i] = _mm256_add_ps(a[i].lo, a[i].hi);
  return {hsum8x8(t), hsum8x8(t + 8)};
}

// The native register, for attention's dot products (kern_attention.inc): one __m256. A 16-lane VF is two,
// and with it a register block of attention held half the rows and loaded more than it multiplied.
struct VN { __m256 v; };
constexpr int kLanesN = 8;
FD_INLINE VN nzero() { return {_mm256_setzero_ps()}; }
FD_INLINE VN nset1(float x) { return {_mm256_set1_ps(x)}; }
FD_INLINE VN nload(const float* p) { return {_mm256_loadu_ps(p)}; }
FD_INLINE void nstore(float* p, VN a) { _mm256_storeu_ps(p, a.v); }
FD_INLINE VN nmul(VN a, VN b) { return {_mm256_mul_ps(a.v, b.v)}; }
FD_INLINE VN nfma(VN a, VN b, VN c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
// Sums of 8 vectors: lane i of the result = sum of the lanes of a[i].
FD_INLINE VN nhsum(const VN* a) {
  const __m256 t[8] = {a[0].v, a[1].v, a[2].v, a[3].v, a[4].v, a[5].v, a[6].v, a[7].v};
  return {hsum8x8(t)};
}
// Attention keeps its fp32 rows (queries, widened keys and values, running outputs) in the lane order bf16
// rows load into with one load and one ALU op per register: per 16 columns, the even ones then the odd ones
// (vload_bf16_shuffled's order; vfrom_lanes = vunshuffle_bf16 puts them back).
constexpr bool kLanesNatural = false;
constexpr int kPartsN = 2;
FD_INLINE VN nload_bf16_part(const uint16_t* p, int part) {
  const __m256i w = _mm256_loadu_si256((const __m256i*)p);
  return {_mm256_castsi256_ps(part == 0 ? _mm256_slli_epi32(w, 16)
                                        : _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
FD_INLINE VF vto_lanes(VF a) {
  const __m256 even = _mm256_shuffle_ps(a.lo, a.hi, 0x88), odd = _mm256_shuffle_ps(a.lo, a.hi, 0xDD);
  return {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)),
          _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8))};
}
FD_INLINE VF vfrom_lanes(VF a) { return vunshuffle_bf16(a); }

FD_INLINE VI izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
FD_INLINE VI iset1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
FD_INLINE VF itof(VI a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
FD_INLINE VI iabs(VI a) { return {_mm256_abs_epi32(a.lo), _mm256_abs_epi32(a.hi)}; }
FD_INLINE VI ftoi(VF a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
FD_INLINE int32_t ireduce_add(VI a) {
  __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i m = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1));
  return _mm_cvtsi128_si32(m);
}

#endif

// exp(x) for float32 lanes: Cody-Waite reduction x = n ln2 + r and a degree-6 polynomial for e^r
// (Cephes coefficients, ~1 ulp). Inputs below -87.3 (including -inf) give exactly 0.
FD_INLINE VF vexp(VF x) {
  // Clamped so that n stays within the normal exponent range [-126, 127].
  VF xc = vmin(vmax(x, vset1(-87.3f)), vset1(88.0f));
  VF n = vround(vmul(xc, vset1(1.44269504088896341f)));
  VF r = vsub(vsub(xc, vmul(n, vset1(0.693359375f))), vmul(n, vset1(-2.12194440e-4f)));
  VF p = vset1(1.9875691500E-4f);
  p = vfma(p, r, vset1(1.3981999507E-3f));
  p = vfma(p, r, vset1(8.3334519073E-3f));
  p = vfma(p, r, vset1(4.1665795894E-2f));
  p = vfma(p, r, vset1(1.6666665459E-1f));
  p = vfma(p, r, vset1(5.0000001201E-1f));
  p = vadd(vfma(vmul(p, r), r, r), vset1(1.0f));
  return vselect_lt(x, -87.3f, vzero(), vldexp(p, n));
}

}  // namespace FD_NS
}  // namespace fd

#include "fd_simd_quant.h"
