// The float32 vector loops of the paged attention (paged_attention.cc), one path per instruction set,
// chosen at build time by the compiler's predefined macros (the library is compiled with -march=native):
// AVX-512, AVX2 with FMA, ARM NEON, then plain loops. No JAX header here: tests/kernels/native_driver.cc
// includes it alone, to check each path against a scalar reference (cross-compiled for ARM, run under
// qemu-user).
//
// Why by hand: GCC leaves the plain loops of these two shapes mostly scalar or 128 bits wide (a dot over
// a 64-float head whose sum is needed at once; an accumulator updated by every slot of a page), and the
// paged loop then reads the cache at a third of the machine's bandwidth. Here:
//  * Dot(a, b, n) = sum_h a[h] * b[h], in two vector accumulators, then across their lanes;
//  * WeightedSum(acc, w, v, stride, count, n): acc[h] += sum_j w[j] * v[j * stride + h] for h < n and
//    j < count, 32 lanes of acc (four 8-wide registers; two 16-wide) held in registers over every j.
// Every path computes the same sums up to the order of float additions.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#define JAXATTN_FLOAT_PATH "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JAXATTN_FLOAT_PATH "avx2"
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define JAXATTN_FLOAT_PATH "neon"
#else
#define JAXATTN_FLOAT_PATH "scalar"
#endif

namespace jaxattn_vec {

constexpr const char* kPath = JAXATTN_FLOAT_PATH;

// The plain loops: the reference the tests compare with, and every path's tail.
inline float DotScalar(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t h = 0; h < n; ++h) sum += a[h] * b[h];
  return sum;
}

inline void WeightedSumScalar(float* acc, const float* w, const float* v, int64_t stride, int64_t count,
                              int64_t from, int64_t n) {
  for (int64_t j = 0; j < count; ++j)
    for (int64_t h = from; h < n; ++h) acc[h] += w[j] * v[j * stride + h];
}

#if defined(__AVX512F__)

inline float Dot(const float* a, const float* b, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t h = 0;
  for (; h + 32 <= n; h += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + h), _mm512_loadu_ps(b + h), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + h + 16), _mm512_loadu_ps(b + h + 16), s1);
  }
  for (; h + 16 <= n; h += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + h), _mm512_loadu_ps(b + h), s0);
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) + DotScalar(a + h, b + h, n - h);
}

inline void WeightedSum(float* acc, const float* w, const float* v, int64_t stride, int64_t count, int64_t n) {
  int64_t h = 0;
  for (; h + 32 <= n; h += 32) {
    __m512 a0 = _mm512_loadu_ps(acc + h), a1 = _mm512_loadu_ps(acc + h + 16);
    for (int64_t j = 0; j < count; ++j) {
      const __m512 wj = _mm512_set1_ps(w[j]);
      const float* vj = v + j * stride + h;
      a0 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vj), a0);
      a1 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vj + 16), a1);
    }
    _mm512_storeu_ps(acc + h, a0);
    _mm512_storeu_ps(acc + h + 16, a1);
  }
  for (; h + 16 <= n; h += 16) {
    __m512 a0 = _mm512_loadu_ps(acc + h);
    for (int64_t j = 0; j < count; ++j) a0 = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_loadu_ps(v + j * stride + h), a0);
    _mm512_storeu_ps(acc + h, a0);
  }
  WeightedSumScalar(acc, w, v, stride, count, h, n);
}

#elif defined(__AVX2__) && defined(__FMA__)

inline float Dot(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t h = 0;
  for (; h + 16 <= n; h += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + h), _mm256_loadu_ps(b + h), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + h + 8), _mm256_loadu_ps(b + h + 8), s1);
  }
  for (; h + 8 <= n; h += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + h), _mm256_loadu_ps(b + h), s0);
  const __m256 s = _mm256_add_ps(s0, s1);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // 8 lanes to 4
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                          // to 2
  q = _mm_add_ss(q, _mm_movehdup_ps(q));                                           // to 1
  return _mm_cvtss_f32(q) + DotScalar(a + h, b + h, n - h);
}

inline void WeightedSum(float* acc, const float* w, const float* v, int64_t stride, int64_t count, int64_t n) {
  int64_t h = 0;
  for (; h + 32 <= n; h += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + h), a1 = _mm256_loadu_ps(acc + h + 8);
    __m256 a2 = _mm256_loadu_ps(acc + h + 16), a3 = _mm256_loadu_ps(acc + h + 24);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 wj = _mm256_broadcast_ss(w + j);
      const float* vj = v + j * stride + h;
      a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj), a0);
      a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8), a1);
      a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 16), a2);
      a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 24), a3);
    }
    _mm256_storeu_ps(acc + h, a0);
    _mm256_storeu_ps(acc + h + 8, a1);
    _mm256_storeu_ps(acc + h + 16, a2);
    _mm256_storeu_ps(acc + h + 24, a3);
  }
  for (; h + 8 <= n; h += 8) {
    __m256 a0 = _mm256_loadu_ps(acc + h);
    for (int64_t j = 0; j < count; ++j)
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + j), _mm256_loadu_ps(v + j * stride + h), a0);
    _mm256_storeu_ps(acc + h, a0);
  }
  WeightedSumScalar(acc, w, v, stride, count, h, n);
}

#elif defined(__ARM_NEON) && defined(__aarch64__)

inline float Dot(const float* a, const float* b, int64_t n) {
  float32x4_t s0 = vdupq_n_f32(0.0f), s1 = vdupq_n_f32(0.0f);
  int64_t h = 0;
  for (; h + 8 <= n; h += 8) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + h), vld1q_f32(b + h));
    s1 = vfmaq_f32(s1, vld1q_f32(a + h + 4), vld1q_f32(b + h + 4));
  }
  for (; h + 4 <= n; h += 4) s0 = vfmaq_f32(s0, vld1q_f32(a + h), vld1q_f32(b + h));
  return vaddvq_f32(vaddq_f32(s0, s1)) + DotScalar(a + h, b + h, n - h);
}

inline void WeightedSum(float* acc, const float* w, const float* v, int64_t stride, int64_t count, int64_t n) {
  int64_t h = 0;
  for (; h + 16 <= n; h += 16) {
    float32x4_t a0 = vld1q_f32(acc + h), a1 = vld1q_f32(acc + h + 4);
    float32x4_t a2 = vld1q_f32(acc + h + 8), a3 = vld1q_f32(acc + h + 12);
    for (int64_t j = 0; j < count; ++j) {
      const float wj = w[j];
      const float* vj = v + j * stride + h;
      a0 = vfmaq_n_f32(a0, vld1q_f32(vj), wj);
      a1 = vfmaq_n_f32(a1, vld1q_f32(vj + 4), wj);
      a2 = vfmaq_n_f32(a2, vld1q_f32(vj + 8), wj);
      a3 = vfmaq_n_f32(a3, vld1q_f32(vj + 12), wj);
    }
    vst1q_f32(acc + h, a0);
    vst1q_f32(acc + h + 4, a1);
    vst1q_f32(acc + h + 8, a2);
    vst1q_f32(acc + h + 12, a3);
  }
  for (; h + 4 <= n; h += 4) {
    float32x4_t a0 = vld1q_f32(acc + h);
    for (int64_t j = 0; j < count; ++j) a0 = vfmaq_n_f32(a0, vld1q_f32(v + j * stride + h), w[j]);
    vst1q_f32(acc + h, a0);
  }
  WeightedSumScalar(acc, w, v, stride, count, h, n);
}

#else

inline float Dot(const float* a, const float* b, int64_t n) { return DotScalar(a, b, n); }

inline void WeightedSum(float* acc, const float* w, const float* v, int64_t stride, int64_t count, int64_t n) {
  WeightedSumScalar(acc, w, v, stride, count, 0, n);
}

#endif

}  // namespace jaxattn_vec
