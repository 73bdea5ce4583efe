// The quantized linear kernels' vocabulary (kern_linear.inc): int8 / int4 weight bytes against int8
// activations, as exact int32 dot products, for AVX-512 (VNNI) and for AVX2; and the float8 (e4m3fn)
// bytes of a block_wise_fp8 KV cache (kern_attention.inc). Included at the end of fd_simd.h, on its VF / VI.
#pragma once

namespace fd {
namespace FD_NS {

// float8 e4m3fn: 1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities, 0x7F / 0xFF NaN.
//
// 8 floats -> their e4m3fn codes in int32 lanes, rounded to nearest even, |y| saturated at 448 (as
// Paddle's cast to float8_e4m3fn): normal values by rounding the float32 mantissa to 3 bits and rebiasing
// the exponent (127 -> 7), those below 2^-6 as multiples of 2^-9.
FD_INLINE __m256i e4m3_codes8(__m256 y) {
  const __m256 a = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), y), _mm256_set1_ps(448.0f));
  const __m256i u = _mm256_castps_si256(a);
  const __m256i half = _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF),
                                        _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1)));
  const __m256i normal =
      _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(u, half), 20), _mm256_set1_epi32(120 << 3));
  const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)));
  const __m256i small = _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 24), _mm256_set1_epi32(0x80));
  return _mm256_or_si256(_mm256_blendv_epi8(normal, sub, small), sign);
}

// vload_e4m3_lanes: 16 codes as 16 floats x s256 (s256 = the row's scale x 256) in attention's lane order
// (fd_simd.h). A code's bits moved into a float16's (exponent field widened from 4 to 5 bits, biased 15) are
// its value / 256, subnormals included, which F16C converts exactly.

#if defined(FD_AVX512)

FD_INLINE VF vload_e4m3_lanes(const uint8_t* p, VF s256) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3F80)),
                                    _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16((short)0x8000)));
  return {_mm512_mul_ps(_mm512_cvtph_ps(h), s256.v)};
}
FD_INLINE void vstore_e4m3(uint8_t* p, VF y) {
  const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(e4m3_codes8(_mm512_castps512_ps256(y.v))),
                                           e4m3_codes8(_mm512_extractf32x8_ps(y.v, 1)), 1);
  _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(codes));
}

struct VB { __m512i v; };  // 64 x uint8 (16 outputs x 4 consecutive k)

// Narrow 16 int32 in [-127, 127] to 16 int8.
FD_INLINE void istore_i8(int8_t* p, VI a) { _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(a.v)); }

FD_INLINE VB bload(const uint8_t* p) { return {_mm512_loadu_si512((const void*)p)}; }
FD_INLINE VB blow_nibbles(VB a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
FD_INLINE VB bhigh_nibbles(VB a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))}; }

// Broadcast of 4 signed activation bytes (k..k+3 of one row).
struct VX { __m512i v; };
FD_INLINE VX xbcast(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return {_mm512_set1_epi32(w)};
}
// acc[i] += sum_r w[4i + r] * x[r], w unsigned 0..255, x signed. No saturation (VNNI).
FD_INLINE VI dot_u8s8(VI acc, VB w, VX x) { return {_mm512_dpbusd_epi32(acc.v, w.v, x.v)}; }
// int8 weights are stored with +128: the dot then counts 128 * sum(x) too, which callers subtract.
constexpr int kInt8Zero = 128;
constexpr bool kInt8AbsRows = false;  // the AVX2 dot below also takes |x|, quantized once per row
FD_INLINE VI dot_int8(VI acc, VB w, VX x, VX) { return dot_u8s8(acc, w, x); }
// Partial sums of one 32-k activation block against int4 weights (nibbles 0..15): pstart(init), at
// most kNibDots dot_nib calls, then pfinish gives init + the exact int32 dot products. VNNI
// accumulates in int32 directly.
constexpr int kNibDots = 8;
struct VP { __m512i v; };
FD_INLINE VP pstart(VI init) { return {init.v}; }
FD_INLINE VP dot_nib(VP acc, VB w, VX x) { return {_mm512_dpbusd_epi32(acc.v, w.v, x.v)}; }
FD_INLINE VI pfinish(VP acc, VI) { return {acc.v}; }

#else  // AVX2 + FMA

// The even columns' codes are the low bytes of 8 16-bit words and the odd ones the high bytes: each half's
// float16s come from the words in place, already in the lane order (even columns, then odd ones).
FD_INLINE VF vload_e4m3_lanes(const uint8_t* p, VF s256) {
  const __m128i w = _mm_loadu_si128((const __m128i*)p);
  const __m128i mag = _mm_set1_epi16(0x3F80), sign = _mm_set1_epi16((short)0x8000);
  const __m128i even =
      _mm_or_si128(_mm_and_si128(_mm_slli_epi16(w, 7), mag), _mm_and_si128(_mm_slli_epi16(w, 8), sign));
  const __m128i odd = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(w, 1), mag), _mm_and_si128(w, sign));
  return {_mm256_mul_ps(_mm256_cvtph_ps(even), s256.lo), _mm256_mul_ps(_mm256_cvtph_ps(odd), s256.hi)};
}
FD_INLINE void vstore_e4m3(uint8_t* p, VF y) {
  __m256i w = _mm256_packus_epi32(e4m3_codes8(y.lo), e4m3_codes8(y.hi));  // lanes interleaved by 128 bits
  w = _mm256_permute4x64_epi64(w, 0xD8);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

struct VB { __m256i lo, hi; };

FD_INLINE void istore_i8(int8_t* p, VI a) {
  __m256i w = _mm256_packs_epi32(a.lo, a.hi);               // 16 x int16, lanes interleaved by 128 bits
  w = _mm256_permute4x64_epi64(w, 0xD8);                     // back in order
  __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128((__m128i*)p, b);
}

FD_INLINE VB bload(const uint8_t* p) {
  return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
}
FD_INLINE VB blow_nibbles(VB a) {
  __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
FD_INLINE VB bhigh_nibbles(VB a) {
  __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(a.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(a.hi, 4), m)};
}

struct VX { __m256i v; };
FD_INLINE VX xbcast(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return {_mm256_set1_epi32(w)};
}
// An empty asm that makes an accumulator opaque: GCC then adds the products into it one after the
// other, as written, instead of reassociating the integer sums into trees whose many partial
// results spill to the stack (16 ymm registers). Values and bits are unchanged.
FD_INLINE void keep_chain(__m256i& a, __m256i& b) { __asm__("" : "+x"(a), "+x"(b)); }
// Only for weights <= 15 (int4): u8 x s8 pair sums then fit int16 without saturation.
FD_INLINE VI dot_u8s8(VI acc, VB w, VX x) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(w.lo, x.v), ones);
  __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(w.hi, x.v), ones);
  return {_mm256_add_epi32(acc.lo, lo), _mm256_add_epi32(acc.hi, hi)};
}
// int8 weights (stored +128) would saturate maddubs: undo the offset and move the signs onto x
// (|x| * sign(w, x)), which keeps every pair sum within int16. The result needs no correction.
// |x| (ax) comes with the activations, stored by their quantization: one instruction less per row
// and 4 k, where these kernels are bound by instructions.
constexpr int kInt8Zero = 0;
constexpr bool kInt8AbsRows = true;
FD_INLINE VI dot_int8(VI acc, VB w, VX x, VX ax) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  __m256i wl = _mm256_sign_epi8(_mm256_xor_si256(w.lo, flip), x.v);
  __m256i wh = _mm256_sign_epi8(_mm256_xor_si256(w.hi, flip), x.v);
  __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(ax.v, wl), ones);
  __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(ax.v, wh), ones);
  VI r{_mm256_add_epi32(acc.lo, lo), _mm256_add_epi32(acc.hi, hi)};
  keep_chain(r.lo, r.hi);
  return r;
}
// Partial sums of one 32-k activation block against int4 weights (nibbles 0..15), kept in int16 and
// widened once in pfinish (one vpmaddwd per 32 k instead of one per 4 k). A vpmaddubsw lane is
// u0 x0 + u1 x1 with u <= 15, |x| <= 128: |.| <= 3840, so kNibDots = 8 of them sum to at most 30720,
// within int16 (no saturation, no wrap): the same exact integers as dot_u8s8, so the same bits.
constexpr int kNibDots = 8;
struct VP { __m256i lo, hi; };  // 16 x int16 each
FD_INLINE VP pstart(VI) { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
FD_INLINE VP dot_nib(VP acc, VB w, VX x) {
  VP r{_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, x.v)),
       _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, x.v))};
  keep_chain(r.lo, r.hi);
  return r;
}
FD_INLINE VI pfinish(VP acc, VI init) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(init.lo, _mm256_madd_epi16(acc.lo, ones)),
          _mm256_add_epi32(init.hi, _mm256_madd_epi16(acc.hi, ones))};
}

#endif

}  // namespace FD_NS
}  // namespace fd
