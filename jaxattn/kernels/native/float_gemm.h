// The register tiles of the native float32 matmul (float_matmul.cc), one path per instruction set, chosen at
// build time by the compiler's predefined macros (the library is compiled with -march=native): AVX-512,
// AVX2 with FMA, ARM NEON, then plain loops. No JAX header here: tests/kernels/native_driver.cc includes it
// alone, to check each path against a double-precision reference (cross-compiled for ARM, run under qemu-user).
//
// Why by hand: XLA:CPU's float32 dot runs a decode step's shapes (a few rows times a weight of hundreds of
// thousands of floats) at about a third of the arithmetic the cores have (docs/performance.md): it is
// neither reading the weight at the memory's speed nor multiplying at the cores' speed. A tile here keeps
// kRows x kVecs vector accumulators in registers over the whole contraction:
//  * RowsTile<R, V>(x, ldx, K, w, N, out, add): out[r, 0:V*kWidth] (+)= sum_{k<K} x[r, k] * w[k, 0:V*kWidth]
//    for r < R, each weight vector loaded once and multiplied into R rows (x row stride ldx, w [K, N]
//    row-major, out row stride N; `add`: added to what out holds, for the bands of k the caller cuts);
//  * DotsTile<R>(x, K, w, out, N): out[r, c] = sum_k x[r, k] * w[c, k] for r < R and c < 4 (w [4, K]
//    row-major: a weight stored transposed, as the tied embedding is for the head).
// Every path computes the same sums up to the order of float additions; each sum runs over k in order
// within a lane (RowsTile exactly in order).
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#define JAXATTN_GEMM_PATH "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JAXATTN_GEMM_PATH "avx2"
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define JAXATTN_GEMM_PATH "neon"
#else
#define JAXATTN_GEMM_PATH "scalar"
#endif

namespace jaxattn_gemm {

constexpr const char* kPath = JAXATTN_GEMM_PATH;

// One vector of kWidth floats and its four operations; kRows x kVecs accumulators fit the register file with
// room for the weight vectors and a broadcast (AVX-512 and NEON: 32 registers; AVX2: 16); a dots tile keeps
// kDotsRows x 4.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kWidth = 16, kRows = 8, kVecs = 3, kDotsRows = 4;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Splat(float a) { return _mm512_set1_ps(a); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kWidth = 8, kRows = 4, kVecs = 3, kDotsRows = 2;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Splat(float a) { return _mm256_set1_ps(a); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float Sum(Vec v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
using Vec = float32x4_t;
constexpr int kWidth = 4, kRows = 6, kVecs = 4, kDotsRows = 4;
inline Vec Zero() { return vdupq_n_f32(0.0f); }
inline Vec Load(const float* p) { return vld1q_f32(p); }
inline Vec Splat(float a) { return vdupq_n_f32(a); }
inline Vec Fma(Vec a, Vec b, Vec c) { return vfmaq_f32(c, a, b); }
inline void Store(float* p, Vec v) { vst1q_f32(p, v); }
inline Vec Add(Vec a, Vec b) { return vaddq_f32(a, b); }
inline float Sum(Vec v) { return vaddvq_f32(v); }
#else
using Vec = float;
constexpr int kWidth = 1, kRows = 4, kVecs = 4, kDotsRows = 4;
inline Vec Zero() { return 0.0f; }
inline Vec Load(const float* p) { return *p; }
inline Vec Splat(float a) { return a; }
inline Vec Fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline void Store(float* p, Vec v) { *p = v; }
inline Vec Add(Vec a, Vec b) { return a + b; }
inline float Sum(Vec v) { return v; }
#endif

// out[r, 0:V*kWidth] (row stride N) for R rows of x (row stride K) times w[0:K, 0:V*kWidth] (row stride N).
template <int R, int V>
void RowsTile(const float* x, int64_t ldx, int64_t K, const float* w, int64_t N, float* out, bool add, int64_t ahead) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Zero();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * N;
    if (ahead) {  // the same columns `ahead` floats on (the next band's row), one prefetch per cache line
      for (int v = 0; v < V * kWidth; v += 16) __builtin_prefetch(wk + ahead + v);
    }
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = Load(wk + v * kWidth);
    for (int r = 0; r < R; ++r) {
      const Vec xr = Splat(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xr, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      float* o = out + r * N + v * kWidth;
      Store(o, add ? Add(Load(o), acc[r][v]) : acc[r][v]);
    }
}

// The columns past the last whole vector: plain sums over k in order.
inline void RowsTail(const float* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * w[k * N + c];
      out[r * N + c] = sum;
    }
}

// out[r, c] (row stride N) = x[r] . w[c] for R rows of x and 4 rows of w (both row stride K).
template <int R>
void DotsTile(const float* x, int64_t K, const float* w, float* out, int64_t N) {
  Vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = Zero();
  int64_t k = 0;
  for (; k + kWidth <= K; k += kWidth) {
    Vec wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = Load(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec xr = Load(x + r * K + k);
      for (int c = 0; c < 4; ++c) acc[r][c] = Fma(xr, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) {
      float sum = Sum(acc[r][c]);
      for (int64_t t = k; t < K; ++t) sum += x[r * K + t] * w[c * K + t];
      out[r * N + c] = sum;
    }
}

// The rows of w past the last 4: one dot each.
inline void DotsTail(const float* x, int64_t rows, int64_t K, const float* w, int64_t cols, float* out, int64_t N) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += x[r * K + k] * w[c * K + k];
      out[r * N + c] = sum;
    }
}

// The tiles a pass takes, by rows (1 .. kRows) and vectors (1 .. kVecs): templated so that the accumulators
// stay in registers, chosen at run time by the rows and columns left.
using RowsFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, bool, int64_t);
using DotsFn = void (*)(const float*, int64_t, const float*, float*, int64_t);

template <int R, int... V>
constexpr auto RowsByVecs(std::integer_sequence<int, V...>) {
  return std::array<RowsFn, sizeof...(V)>{&RowsTile<R, V + 1>...};
}

template <int... R>
constexpr auto RowsTable(std::integer_sequence<int, R...>) {
  return std::array<std::array<RowsFn, kVecs>, sizeof...(R)>{RowsByVecs<R + 1>(std::make_integer_sequence<int, kVecs>{})...};
}

template <int... R>
constexpr auto DotsTable(std::integer_sequence<int, R...>) {
  return std::array<DotsFn, sizeof...(R)>{&DotsTile<R + 1>...};
}

// kRowsTiles[rows - 1][vecs - 1] (rows <= kRows), kDotsTiles[rows - 1] (rows <= kDotsRows).
inline const auto kRowsTiles = RowsTable(std::make_integer_sequence<int, kRows>{});
inline const auto kDotsTiles = DotsTable(std::make_integer_sequence<int, kDotsRows>{});

}  // namespace jaxattn_gemm
