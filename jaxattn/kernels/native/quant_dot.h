// The integer dots of the quantized matmul (quant_matmul.cc), one path per instruction set, chosen at
// build time by the compiler's predefined macros (the library is compiled with -march=native):
// AVX512-VNNI, AVX-VNNI, AVX2, ARM NEON with the dot-product extension, plain NEON, then a scalar loop.
// No JAX header here: tests/kernels/native_driver.cc includes it alone, to check each path against a
// scalar reference (cross-compiled for ARM and run under qemu-user).
//
// Every path computes the same integer sums. `Acc16` holds 16 columns' int32 sums; each of its 32-bit
// lanes takes 4 products at a time ("a quad": 4 consecutive bytes of one column), as VNNI's dpbusd does:
//  * DotS8(acc, LoadS8(w), x4): w is 64 int8 weights, bytes 4c .. 4c + 3 the quad of column c; x4 the
//    4 int8 activations of those rows in one int32. acc[c] += sum_i w[4c + i] * x[i], plus kS8Bias *
//    sum_i x[i] (the AVX512-VNNI path makes w unsigned, w + 128, the operand dpbusd takes as unsigned;
//    the caller takes kS8Bias * the group's sum of x off again; the others multiply signed by signed).
//  * DotU4(acc, LoadU4(w), even, odd): w is 16 int4 words (column c in word c), each 8 unsigned
//    nibbles, byte b holding rows 2b (low nibble) and 2b + 1 (high); even and odd the 4 int8
//    activations of the even and odd rows. acc[c] += sum_b lo(w[c], b) * even[b] + hi(w[c], b) * odd[b]
//    (the nibbles' offset of 8 is the caller's).
//  * Lanes(acc, out): the 16 sums in order.
// A weight is loaded (and split) once by LoadS8 / LoadU4, then dotted with each row's activations.
// AVX2 has no u8 x s8 dot into int32: _mm256_maddubs_epi16 (pairs into int16) then _mm256_madd_epi16
// (pairs of those into int32), as llama.cpp's Q8_0 dot does; for signed x signed, the weight's absolute
// value times the activation given the weight's sign (an int8 weight of -128 is 128 as unsigned; the
// activations are within +-127, so no int16 pair saturates: 2 * 128 * 127 < 32768). Plain NEON has no
// dot: vmull_s8 (int16 products), then pairwise adds to int32.
#pragma once

#include <cstdint>

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JAXATTN_VNNI 1  // quant_matmul.cc's int8 rows kernel has an AVX512-VNNI loop of its own
#define JAXATTN_DOT_PATH "avx512vnni"
#elif defined(__AVXVNNI__) && defined(__AVX2__)
#include <immintrin.h>
#define JAXATTN_DOT_256 1
#define JAXATTN_DOT_PATH "avxvnni"
#elif defined(__AVX2__)
#include <immintrin.h>
#define JAXATTN_DOT_256 1
#define JAXATTN_DOT_PATH "avx2"
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define JAXATTN_DOT_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define JAXATTN_DOT_PATH "neon-dotprod"
#else
#define JAXATTN_DOT_PATH "neon"
#endif
#else
#define JAXATTN_DOT_PATH "scalar"
#endif

namespace jaxattn_dot {

// The path this file was compiled to (see the macros above).
constexpr const char* kPath = JAXATTN_DOT_PATH;

#if defined(JAXATTN_VNNI)

constexpr int32_t kS8Bias = 128;
struct Acc16 { __m512i v; };
struct S8 { __m512i u; };         // w + 128
struct U4 { __m512i low, high; };  // the nibbles, each in a byte
inline Acc16 Zero() { return {_mm512_setzero_si512()}; }
inline S8 LoadS8(const int8_t* w) {
  return {_mm512_xor_si512(_mm512_loadu_si512(w), _mm512_set1_epi8(static_cast<char>(0x80)))};
}
inline U4 LoadU4(const uint32_t* w) {
  const __m512i v = _mm512_loadu_si512(w), nibble = _mm512_set1_epi32(0x0F0F0F0F);
  return {_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble)};
}
inline void DotS8(Acc16& acc, const S8& w, int32_t x4) { acc.v = _mm512_dpbusd_epi32(acc.v, w.u, _mm512_set1_epi32(x4)); }
inline void DotU4(Acc16& acc, const U4& w, int32_t even, int32_t odd) {
  acc.v = _mm512_dpbusd_epi32(acc.v, w.low, _mm512_set1_epi32(even));
  acc.v = _mm512_dpbusd_epi32(acc.v, w.high, _mm512_set1_epi32(odd));
}
inline void Lanes(const Acc16& acc, int32_t* out) { _mm512_storeu_si512(out, acc.v); }

#elif defined(JAXATTN_DOT_256)

constexpr int32_t kS8Bias = 0;
struct Acc16 { __m256i v[2]; };
struct S8 { __m256i w[2], magnitude[2]; };
struct U4 { __m256i low[2], high[2]; };
inline Acc16 Zero() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
// acc + the sums of 4 products u * s per 32-bit lane (u unsigned; each pair of products within int16).
inline __m256i DotUS(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline S8 LoadS8(const int8_t* w) {
  S8 s;
  for (int h = 0; h < 2; ++h) {
    s.w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
    s.magnitude[h] = _mm256_abs_epi8(s.w[h]);
  }
  return s;
}
inline U4 LoadU4(const uint32_t* w) {
  const __m256i nibble = _mm256_set1_epi32(0x0F0F0F0F);
  U4 u;
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * h));
    u.low[h] = _mm256_and_si256(v, nibble), u.high[h] = _mm256_and_si256(_mm256_srli_epi32(v, 4), nibble);
  }
  return u;
}
// |w| times x given w's sign: w * x with the unsigned operand on the weight's side.
inline void DotS8(Acc16& acc, const S8& w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  for (int h = 0; h < 2; ++h) acc.v[h] = DotUS(acc.v[h], w.magnitude[h], _mm256_sign_epi8(x, w.w[h]));
}
inline void DotU4(Acc16& acc, const U4& w, int32_t even, int32_t odd) {
  const __m256i e = _mm256_set1_epi32(even), o = _mm256_set1_epi32(odd);
  for (int h = 0; h < 2; ++h) acc.v[h] = DotUS(DotUS(acc.v[h], w.low[h], e), w.high[h], o);
}
inline void Lanes(const Acc16& acc, int32_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), acc.v[0]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8), acc.v[1]);
}

#elif defined(JAXATTN_DOT_NEON)

constexpr int32_t kS8Bias = 0;
struct Acc16 { int32x4_t v[4]; };
struct S8 { int8x16_t w[4]; };
struct U4 { int8x16_t low[4], high[4]; };
inline Acc16 Zero() { return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}}; }
// acc + the sums of 4 products a * b per 32-bit lane.
inline int32x4_t Dot4(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  const int32x4_t low = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  const int32x4_t high = vpaddlq_s16(vmull_high_s8(a, b));
  return vaddq_s32(acc, vpaddq_s32(low, high));
#endif
}
inline S8 LoadS8(const int8_t* w) { return {{vld1q_s8(w), vld1q_s8(w + 16), vld1q_s8(w + 32), vld1q_s8(w + 48)}}; }
inline U4 LoadU4(const uint32_t* w) {
  U4 u;
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t v = vreinterpretq_u8_u32(vld1q_u32(w + 4 * i));
    u.low[i] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), u.high[i] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
  }
  return u;
}
inline void DotS8(Acc16& acc, const S8& w, int32_t x4) {
  const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
  for (int i = 0; i < 4; ++i) acc.v[i] = Dot4(acc.v[i], w.w[i], x);
}
inline void DotU4(Acc16& acc, const U4& w, int32_t even, int32_t odd) {
  const int8x16_t e = vreinterpretq_s8_s32(vdupq_n_s32(even)), o = vreinterpretq_s8_s32(vdupq_n_s32(odd));
  for (int i = 0; i < 4; ++i) acc.v[i] = Dot4(Dot4(acc.v[i], w.low[i], e), w.high[i], o);
}
inline void Lanes(const Acc16& acc, int32_t* out) {
  for (int i = 0; i < 4; ++i) vst1q_s32(out + 4 * i, acc.v[i]);
}

#else

constexpr int32_t kS8Bias = 0;
struct Acc16 { int32_t v[16]; };
struct S8 { const int8_t* w; };
struct U4 { const uint32_t* w; };
inline Acc16 Zero() { return {}; }
inline S8 LoadS8(const int8_t* w) { return {w}; }
inline U4 LoadU4(const uint32_t* w) { return {w}; }
inline int32_t Byte(int32_t word, int b) { return static_cast<int8_t>(static_cast<uint32_t>(word) >> (8 * b)); }
inline void DotS8(Acc16& acc, const S8& w, int32_t x4) {
  for (int c = 0; c < 16; ++c)
    for (int b = 0; b < 4; ++b) acc.v[c] += static_cast<int32_t>(w.w[4 * c + b]) * Byte(x4, b);
}
inline void DotU4(Acc16& acc, const U4& w, int32_t even, int32_t odd) {
  for (int c = 0; c < 16; ++c)
    for (int b = 0; b < 4; ++b)
      acc.v[c] += static_cast<int32_t>((w.w[c] >> (8 * b)) & 15u) * Byte(even, b) +
                  static_cast<int32_t>((w.w[c] >> (8 * b + 4)) & 15u) * Byte(odd, b);
}
inline void Lanes(const Acc16& acc, int32_t* out) {
  for (int c = 0; c < 16; ++c) out[c] = acc.v[c];
}

#endif

}  // namespace jaxattn_dot
