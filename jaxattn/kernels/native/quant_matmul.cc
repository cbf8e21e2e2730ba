// A few float32 rows times an int8 or int4 weight, float32 out, on the CPU: the native part of the
// "native_cpu" and "native_cpu_q8act" quantized matmuls (jaxattn/kernels/quant_matmul.py, registered
// with jax.ffi).
//
// Contract (jaxattn.quantization.dequantize, then x @ W): x [M, K] float32; scales [G, N] float32,
// one per group of K / G input rows and column (G = 1: one per column);
//  * bits 8 (target JaxattnQuantMatmul8): values [K, N] int8, W = values * scale;
//  * bits 4 (target JaxattnQuantMatmul4): values [K / 8, N] int32, word [t, j] holds rows 8t .. 8t + 7
//    of column j, row 8t + i in bits 4i .. 4i + 3 as an unsigned nibble u, W = (u - 8) * scale; or, with
//    minimums (shaped as scales; an empty buffer: none), W = u * scale + minimum (llama.cpp's Q4_1).
// out [M, N] = x @ W. With q8act = 1 (int4 in groups of a multiple of 32 rows, or int8 with one scale
// per column, or in panels in groups of a multiple of 32 rows; K a multiple of 32), x is first rounded
// to int8 per row in groups of 32 (`xs = max|x| / 127` per group, `xq = round(x / xs)`, as
// jaxattn.kernels.quant_matmul.quantize_rows) and out = (xq * xs) @ W: the products are integer dots,
// scaled per group of 32.
//
// Why by hand: XLA:CPU converts the int8 weight to float32 in a separate pass before its dot, so it
// reads and writes a float32 copy of the weight on every call. Here W is read once and converted as
// it is used. The columns are cut into pieces (at most kChunkBytes of a row) that the workers (XLA's
// intra-op thread pool) take in turn; each piece reads all K rows of its columns and writes its own
// outputs, so no sums are shared. Summation order differs from the reference's only by float32 rounding.
//
// The int4 words put a column's 8 consecutive rows in 32 bits so that one 32-bit lane of an integer
// dot holds 4 rows of one column: the integer dots of quant_dot.h (one path per instruction set,
// chosen at build time by -march=native; JaxattnQuantMatmulPath names it) multiply 16 columns'
// unsigned nibbles by 4 int8 activations each, summed in int32; the nibbles' offset of 8 is taken off
// once per group (8 * the sum of the group's xq). Columns past the last 16 run in plain loops with the
// same sums. int8 values stay [K, N] (the layout GGUF and the reference share): with AVX512-VNNI,
// Int8Q8 interleaves four rows itself, a few shuffles per 256 products; without it, plain loops the
// compiler vectorizes (the panels layout is the one with a dot per instruction set).
//
// Panels (targets JaxattnQuantMatmul8Panels and JaxattnQuantMatmul4Panels, q8act only): the same
// weight cut into panels of 16 columns, each panel's rows contiguous (jaxattn.quantization's "panels"
// layout): int8 values [N / 16, K / 4, 64], byte 4c + i of row t of panel p holding W[4t + i, 16p + c];
// int4 words [N / 16, K / 8, 16], word c of row t of panel p the rows layout's word [t, 16p + c];
// scales [N / 16, G, 16]. A piece of consecutive panels is one contiguous stream through memory (the
// rows layout has 32 streams N bytes apart per group), and an int8 row of a panel is already the
// 4-rows-per-lane operand the integer dot takes: no interleaving, no reordering.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "quant_dot.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunkBytes = 4096;  // bytes of each weight row per piece of work, at most
constexpr int64_t kMinWeights = 96 * 1024;  // weights per worker, at least: waking one costs more below
constexpr int64_t kActGroup = 32;  // activation rows per int8 scale (q8act)
constexpr int64_t kMaxRows = 16;  // rows per pass over the weight (more rows: several passes)

struct Problem {
  const float* x;
  const void* w;
  const float* scales;
  const float* mins;  // int4 with minimums (W = u * scale + minimum), laid out as scales; else nullptr
  int64_t M, K, N, bits, G;
  int64_t group;  // input rows per weight scale (K when G == 1)
  bool q8;
  bool panels;  // the panels layout (q8 only)
  // q8act: per row, words of 4 int8 activations (even rows 8t, 8t+2, 8t+4, 8t+6 and odd rows 8t+1, ..),
  // the scales xs [M, K / 32] and the sums of xq per group of 32 [M, K / 32].
  std::vector<int32_t> even, odd, xsum;
  std::vector<int32_t> quads;  // per row, words of 4 consecutive xq (rows 4t .. 4t + 3; int8 weights)
  std::vector<float> xs;
};

// Rows as int8 in groups of 32 (see the contract), in the words the integer dots take.
void QuantizeRows(Problem& p) {
  const int64_t A = p.K / kActGroup, T = p.K / 8;
  p.even.assign(p.M * T, 0), p.odd.assign(p.M * T, 0), p.xsum.assign(p.M * A, 0), p.xs.assign(p.M * A, 0.0f);
  p.quads.assign(p.M * p.K / 4, 0);
  std::vector<int8_t> q(p.K);
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    for (int64_t a = 0; a < A; ++a) {
      float top = 0.0f;
      for (int64_t k = a * kActGroup; k < (a + 1) * kActGroup; ++k) top = std::max(top, std::fabs(x[k]));
      const float scale = top / 127.0f, safe = scale > 0.0f ? scale : 1.0f;
      int32_t sum = 0;
      for (int64_t k = a * kActGroup; k < (a + 1) * kActGroup; ++k) {
        const float r = std::nearbyint(x[k] / safe);
        q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
        sum += q[k];
      }
      p.xs[m * A + a] = scale, p.xsum[m * A + a] = sum;
    }
    std::copy(q.begin(), q.end(), reinterpret_cast<int8_t*>(p.quads.data() + m * p.K / 4));
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* b = reinterpret_cast<const uint8_t*>(q.data() + 8 * t);
      p.even[m * T + t] = static_cast<int32_t>(b[0] | (b[2] << 8) | (b[4] << 16) | (static_cast<uint32_t>(b[6]) << 24));
      p.odd[m * T + t] = static_cast<int32_t>(b[1] | (b[3] << 8) | (b[5] << 16) | (static_cast<uint32_t>(b[7]) << 24));
    }
  }
}

// out[m0:m1, j0:j1] for int8 values, float32: each row of W converted as it is read.
void Int8Float(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1, float* out, float* part) {
  const int8_t* w = static_cast<const int8_t*>(p.w);
  const int64_t n = j1 - j0, M = m1 - m0;
  for (int64_t g = 0; g < p.G; ++g) {
    float* __restrict sums = part;
    std::fill(sums, sums + M * n, 0.0f);
    // Four rows at a time: the sums are read and written once for four rows' products.
    int64_t k = g * p.group;
    for (; k + 4 <= (g + 1) * p.group; k += 4) {
      const int8_t* __restrict r0 = w + k * p.N + j0;
      const int8_t* __restrict r1 = r0 + p.N;
      const int8_t* __restrict r2 = r1 + p.N;
      const int8_t* __restrict r3 = r2 + p.N;
      for (int64_t m = 0; m < M; ++m) {
        const float* xk = p.x + (m0 + m) * p.K + k;
        const float x0 = xk[0], x1 = xk[1], x2 = xk[2], x3 = xk[3];
        float* __restrict a = sums + m * n;
        for (int64_t j = 0; j < n; ++j)
          a[j] += x0 * static_cast<float>(r0[j]) + x1 * static_cast<float>(r1[j]) + x2 * static_cast<float>(r2[j]) +
                  x3 * static_cast<float>(r3[j]);
      }
    }
    for (; k < (g + 1) * p.group; ++k) {
      const int8_t* __restrict src = w + k * p.N + j0;
      for (int64_t m = 0; m < M; ++m) {
        const float xk = p.x[(m0 + m) * p.K + k];
        float* __restrict a = sums + m * n;
        for (int64_t j = 0; j < n; ++j) a[j] += xk * static_cast<float>(src[j]);
      }
    }
    const float* __restrict s = p.scales + g * p.N + j0;
    for (int64_t m = 0; m < M; ++m) {
      float* __restrict o = out + (m0 + m) * p.N + j0;
      for (int64_t j = 0; j < n; ++j) o[j] += sums[m * n + j] * s[j];
    }
  }
}

// out[m0:m1, j0:j1] for int4 words, float32: each nibble converted to float as it is read.
void Int4Float(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1, float* out, float* part) {
  const uint32_t* w = static_cast<const uint32_t*>(p.w);
  const int64_t n = j1 - j0, M = m1 - m0;
  for (int64_t g = 0; g < p.G; ++g) {
    float* __restrict sums = part;
    std::fill(sums, sums + M * n, 0.0f);
    for (int64_t t = g * p.group / 8; t < (g + 1) * p.group / 8; ++t) {
      const uint32_t* __restrict src = w + t * p.N + j0;
      for (int64_t m = 0; m < M; ++m) {
        const float* xk = p.x + (m0 + m) * p.K + 8 * t;
        float x[8], offset = 0.0f;  // sum_i x_i (u_i - 8) = sum_i x_i u_i - 8 sum_i x_i (minimums: added below)
        for (int i = 0; i < 8; ++i) x[i] = xk[i], offset += p.mins ? 0.0f : 8.0f * xk[i];
        float* __restrict a = sums + m * n;
        for (int64_t j = 0; j < n; ++j) {
          const uint32_t v = src[j];
          float s = -offset;
          for (int i = 0; i < 8; ++i) s += x[i] * static_cast<float>(static_cast<int32_t>((v >> (4 * i)) & 15u));
          a[j] += s;
        }
      }
    }
    const float* __restrict s = p.scales + g * p.N + j0;
    for (int64_t m = 0; m < M; ++m) {
      float* __restrict o = out + (m0 + m) * p.N + j0;
      for (int64_t j = 0; j < n; ++j) o[j] += sums[m * n + j] * s[j];
      if (!p.mins) continue;
      float xsum = 0.0f;  // sum_k x_k minimum_j over the group
      for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) xsum += p.x[(m0 + m) * p.K + k];
      const float* __restrict mn = p.mins + g * p.N + j0;
      for (int64_t j = 0; j < n; ++j) o[j] += xsum * mn[j];
    }
  }
}

// out[0:16] += (the 16 int32 sums - offset) * (scale[c] or 1) * xs: a group's integer dots into float32.
// The int4 form (AddScaled4): without minimums as AddScaled with 8 * the group's sum of xq taken off; with
// them (W = u * scale + minimum), out[c] += xs * (sum_k xq_k u_k * scale[c] + sum_k xq_k * minimum[c]).
// Once per row, group and 16 columns: in vector registers where the dots are (a plain loop here cost about
// as much as the dots themselves, so each row past the first nearly doubled a call's time).
#if defined(JAXATTN_VNNI)
inline __m512 Sums(const jaxattn_dot::Acc16& acc, int32_t offset) {
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(acc.v, _mm512_set1_epi32(offset)));
}
inline void AddScaled(float* out, const jaxattn_dot::Acc16& acc, int32_t offset, const float* scale, float xs) {
  const __m512 factor = scale ? _mm512_mul_ps(_mm512_loadu_ps(scale), _mm512_set1_ps(xs)) : _mm512_set1_ps(xs);
  _mm512_storeu_ps(out, _mm512_fmadd_ps(Sums(acc, offset), factor, _mm512_loadu_ps(out)));
}
inline void AddScaled4(float* out, const jaxattn_dot::Acc16& acc, int32_t xsum, const float* scale, const float* mins,
                       float xs) {
  if (!mins) return AddScaled(out, acc, 8 * xsum, scale, xs);
  const __m512 inner = _mm512_fmadd_ps(Sums(acc, 0), _mm512_loadu_ps(scale),
                                       _mm512_mul_ps(_mm512_set1_ps(static_cast<float>(xsum)), _mm512_loadu_ps(mins)));
  _mm512_storeu_ps(out, _mm512_fmadd_ps(inner, _mm512_set1_ps(xs), _mm512_loadu_ps(out)));
}
#elif defined(JAXATTN_DOT_256) && defined(__FMA__)
inline __m256 Sums(const jaxattn_dot::Acc16& acc, int h, int32_t offset) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(acc.v[h], _mm256_set1_epi32(offset)));
}
inline void AddScaled(float* out, const jaxattn_dot::Acc16& acc, int32_t offset, const float* scale, float xs) {
  for (int h = 0; h < 2; ++h) {
    const __m256 factor = scale ? _mm256_mul_ps(_mm256_loadu_ps(scale + 8 * h), _mm256_set1_ps(xs)) : _mm256_set1_ps(xs);
    _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(Sums(acc, h, offset), factor, _mm256_loadu_ps(out + 8 * h)));
  }
}
inline void AddScaled4(float* out, const jaxattn_dot::Acc16& acc, int32_t xsum, const float* scale, const float* mins,
                       float xs) {
  if (!mins) return AddScaled(out, acc, 8 * xsum, scale, xs);
  for (int h = 0; h < 2; ++h) {
    const __m256 inner = _mm256_fmadd_ps(Sums(acc, h, 0), _mm256_loadu_ps(scale + 8 * h),
                                         _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(xsum)), _mm256_loadu_ps(mins + 8 * h)));
    _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(inner, _mm256_set1_ps(xs), _mm256_loadu_ps(out + 8 * h)));
  }
}
#else
inline void AddScaled(float* out, const jaxattn_dot::Acc16& acc, int32_t offset, const float* scale, float xs) {
  int32_t sums[16];
  jaxattn_dot::Lanes(acc, sums);
  for (int c = 0; c < 16; ++c) out[c] += static_cast<float>(sums[c] - offset) * ((scale ? scale[c] : 1.0f) * xs);
}
inline void AddScaled4(float* out, const jaxattn_dot::Acc16& acc, int32_t xsum, const float* scale, const float* mins,
                       float xs) {
  if (!mins) return AddScaled(out, acc, 8 * xsum, scale, xs);
  int32_t sums[16];
  jaxattn_dot::Lanes(acc, sums);
  for (int c = 0; c < 16; ++c) out[c] += xs * (static_cast<float>(sums[c]) * scale[c] + static_cast<float>(xsum) * mins[c]);
}
#endif

// out[m0:m1, j0:j1] for int4 words and int8 activations: integer dots per group of 32 rows. The rows
// of a group are read along the piece's columns (four streams through memory), each 16 columns' int32
// sums kept in registers for the group (quant_dot.h), then scaled into the float32 outputs; the
// columns past the last 16 in a plain loop with the same sums.
void Int4Q8(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1, float* out) {
  using namespace jaxattn_dot;
  const uint32_t* w = static_cast<const uint32_t*>(p.w);
  const int64_t A = p.K / kActGroup, T = p.K / 8, M = m1 - m0;
  const int64_t rest = j0 + (j1 - j0) / 16 * 16;  // the columns from here on run in plain loops
  for (int64_t m = m0; m < m1; ++m) std::fill(out + m * p.N + j0, out + m * p.N + j1, 0.0f);
  for (int64_t a = 0; a < A; ++a) {
    const float* sa = p.scales + (a * kActGroup / p.group) * p.N;
    const float* ma = p.mins ? p.mins + (a * kActGroup / p.group) * p.N : nullptr;
    for (int64_t j = j0; j < rest; j += 16) {
      Acc16 acc[kMaxRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = Zero();
      for (int64_t t = a * 4; t < a * 4 + 4; ++t) {
        const U4 v = LoadU4(w + t * p.N + j);
        for (int64_t m = 0; m < M; ++m) DotU4(acc[m], v, p.even[(m0 + m) * T + t], p.odd[(m0 + m) * T + t]);
      }
      for (int64_t m = 0; m < M; ++m)
        AddScaled4(out + (m0 + m) * p.N + j, acc[m], p.xsum[(m0 + m) * A + a], sa + j, ma ? ma + j : nullptr,
                   p.xs[(m0 + m) * A + a]);
    }
  }
  const int64_t left = j1 - rest;
  if (left == 0) return;
  std::vector<int32_t> acc(left);
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* even = reinterpret_cast<const int8_t*>(p.even.data() + m * T);
    const int8_t* odd = reinterpret_cast<const int8_t*>(p.odd.data() + m * T);
    float* __restrict o = out + m * p.N + rest;
    for (int64_t a = 0; a < A; ++a) {
      std::fill(acc.begin(), acc.end(), 0);
      for (int64_t t = a * 4; t < a * 4 + 4; ++t) {
        const uint32_t* __restrict src = w + t * p.N + rest;
        const int8_t* e = even + 4 * t;
        const int8_t* d = odd + 4 * t;
        for (int64_t c = 0; c < left; ++c) {
          const uint32_t v = src[c];
          int32_t s = 0;
          for (int b = 0; b < 4; ++b)
            s += static_cast<int32_t>((v >> (8 * b)) & 15u) * e[b] + static_cast<int32_t>((v >> (8 * b + 4)) & 15u) * d[b];
          acc[c] += s;
        }
      }
      const float* __restrict s = p.scales + (a * kActGroup / p.group) * p.N + rest;
      const float xs = p.xs[m * A + a];
      const int32_t xsum = p.xsum[m * A + a];
      if (p.mins) {
        const float* __restrict mn = p.mins + (a * kActGroup / p.group) * p.N + rest;
        for (int64_t c = 0; c < left; ++c)
          o[c] += xs * (static_cast<float>(acc[c]) * s[c] + static_cast<float>(xsum) * mn[c]);
        continue;
      }
      for (int64_t c = 0; c < left; ++c) o[c] += static_cast<float>(acc[c] - 8 * xsum) * (s[c] * xs);
    }
  }
}

// out[m0:m1, j0:j1] for int8 values (one scale per column) and int8 activations: integer dots per
// group of 32 rows. Four rows of 64 columns are interleaved by two rounds of byte and 16-bit unpacks
// so that each 32-bit lane holds 4 rows of one column (the columns come out in a fixed order within
// each 64, put back at the end); the weights are made unsigned (w + 128, the operand VNNI takes as
// unsigned) and 128 * the group's sum of xq taken off again.
#ifdef JAXATTN_VNNI
// Four rows (`stride` apart) of 64 columns made unsigned (w + 128) and interleaved: lane c of v[i]
// holds the 4 rows of column 16 * (c / 4) + 4 * i + c % 4.
inline void Interleave(const int8_t* r, int64_t stride, __m512i flip, __m512i v[4]) {
  const __m512i r0 = _mm512_xor_si512(_mm512_loadu_si512(r), flip);
  const __m512i r1 = _mm512_xor_si512(_mm512_loadu_si512(r + stride), flip);
  const __m512i r2 = _mm512_xor_si512(_mm512_loadu_si512(r + 2 * stride), flip);
  const __m512i r3 = _mm512_xor_si512(_mm512_loadu_si512(r + 3 * stride), flip);
  const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
  const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
  v[0] = _mm512_unpacklo_epi16(lo01, lo23), v[1] = _mm512_unpackhi_epi16(lo01, lo23);
  v[2] = _mm512_unpacklo_epi16(hi01, hi23), v[3] = _mm512_unpackhi_epi16(hi01, hi23);
}
#endif

void Int8Q8(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1, float* out, int32_t* sums) {
  const int8_t* w = static_cast<const int8_t*>(p.w);
  const int64_t A = p.K / kActGroup, T = p.K / 4, M = m1 - m0;
  for (int64_t m = m0; m < m1; ++m) std::fill(out + m * p.N + j0, out + m * p.N + j1, 0.0f);
  int64_t rest = j0;  // the columns from here on run in plain loops
#ifdef JAXATTN_VNNI
  const int64_t vector_cols = (j1 - j0) / 64 * 64;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const bool aliased = p.N % 4096 == 0;
  for (int64_t a = 0; a < A; ++a) {
    __m512 xs[kMaxRows];
    __m512i offset[kMaxRows];
    for (int64_t m = 0; m < M; ++m) {
      xs[m] = _mm512_set1_ps(p.xs[(m0 + m) * A + a]);
      offset[m] = _mm512_set1_epi32(128 * p.xsum[(m0 + m) * A + a]);
    }
    if (!aliased) {
      // Each 64 columns' int32 sums in registers over the group's 32 rows.
      for (int64_t j = j0; j < j0 + vector_cols; j += 64) {
        __m512i acc[kMaxRows][4];
        for (int64_t m = 0; m < M; ++m)
          for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_si512();
        for (int64_t q = 0; q < kActGroup / 4; ++q) {
          __m512i v[4];
          Interleave(w + (a * kActGroup + 4 * q) * p.N + j, p.N, flip, v);
          for (int64_t m = 0; m < M; ++m) {
            const __m512i xq = _mm512_set1_epi32(p.quads[(m0 + m) * T + a * (kActGroup / 4) + q]);
            for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_dpbusd_epi32(acc[m][i], v[i], xq);
          }
        }
        for (int64_t m = 0; m < M; ++m) {
          float* o = out + (m0 + m) * p.N + j;  // in the unpacks' order until the end
          for (int i = 0; i < 4; ++i) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][i], offset[m]));
            _mm512_storeu_ps(o + 16 * i, _mm512_fmadd_ps(dot, xs[m], _mm512_loadu_ps(o + 16 * i)));
          }
        }
      }
      continue;
    }
    // Rows a multiple of 4 KiB apart share cache sets: the group's 32 rows read at once would evict
    // one another's prefetched lines. So four rows at a time along the piece's columns (four streams
    // through memory), the int32 sums of the group in `sums` [M, vector_cols].
    std::fill(sums, sums + M * vector_cols, 0);
    for (int64_t q = 0; q < kActGroup / 4; ++q) {
      __m512i xq[kMaxRows];
      for (int64_t m = 0; m < M; ++m) xq[m] = _mm512_set1_epi32(p.quads[(m0 + m) * T + a * (kActGroup / 4) + q]);
      for (int64_t j = j0; j < j0 + vector_cols; j += 64) {
        __m512i v[4];
        Interleave(w + (a * kActGroup + 4 * q) * p.N + j, p.N, flip, v);
        for (int64_t m = 0; m < M; ++m) {
          int32_t* acc = sums + m * vector_cols + (j - j0);
          for (int i = 0; i < 4; ++i)
            _mm512_storeu_si512(acc + 16 * i, _mm512_dpbusd_epi32(_mm512_loadu_si512(acc + 16 * i), v[i], xq[m]));
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float* o = out + (m0 + m) * p.N + j0;  // in the unpacks' order until the end
      const int32_t* acc = sums + m * vector_cols;
      for (int64_t c = 0; c < vector_cols; c += 16) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc + c), offset[m]));
        _mm512_storeu_ps(o + c, _mm512_fmadd_ps(dot, xs[m], _mm512_loadu_ps(o + c)));
      }
    }
  }
  // Back in order (lane block b of vector i holds columns 16b + 4i .. 16b + 4i + 3), times the scales.
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t j = j0; j < j0 + vector_cols; j += 64) {
      float* o = out + m * p.N + j;
      const __m512 v0 = _mm512_loadu_ps(o), v1 = _mm512_loadu_ps(o + 16), v2 = _mm512_loadu_ps(o + 32),
                   v3 = _mm512_loadu_ps(o + 48);
      const __m512 t0 = _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 t1 = _mm512_shuffle_f32x4(v2, v3, _MM_SHUFFLE(1, 0, 1, 0));
      const __m512 t2 = _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 2, 3, 2));
      const __m512 t3 = _mm512_shuffle_f32x4(v2, v3, _MM_SHUFFLE(3, 2, 3, 2));
      const __m512 ordered[4] = {_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)),
                                 _mm512_shuffle_f32x4(t2, t3, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(t2, t3, _MM_SHUFFLE(3, 1, 3, 1))};
      for (int i = 0; i < 4; ++i)
        _mm512_storeu_ps(o + 16 * i, _mm512_mul_ps(ordered[i], _mm512_loadu_ps(p.scales + j + 16 * i)));
    }
  rest = j0 + vector_cols;
#endif
  // The same integer sums without VNNI (and the columns past the last 64).
  const int64_t left = j1 - rest;
  if (left == 0) return;
  std::vector<int32_t> acc(left);
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* xq = reinterpret_cast<const int8_t*>(p.quads.data() + m * T);
    float* __restrict o = out + m * p.N + rest;
    for (int64_t a = 0; a < A; ++a) {
      std::fill(acc.begin(), acc.end(), 0);
      for (int64_t k = a * kActGroup; k < (a + 1) * kActGroup; ++k) {
        const int8_t* __restrict src = w + k * p.N + rest;
        const int32_t x = xq[k];
        for (int64_t c = 0; c < left; ++c) acc[c] += x * static_cast<int32_t>(src[c]);
      }
      const float xs = p.xs[m * A + a];
      for (int64_t c = 0; c < left; ++c) o[c] += static_cast<float>(acc[c]) * xs;
    }
    for (int64_t c = 0; c < left; ++c) o[c] *= p.scales[rest + c];
  }
}

// Up to kPanelRows rows of x times one panel of 16 columns (either width of values), the int32 sums
// of each group of 32 rows turned to float32 as the rows layout's kernels do. R: the rows (templated so
// that the accumulators stay in registers).
constexpr int64_t kPanelRows = 4;

template <int R>
void Int8Q8Panel(const Problem& p, int64_t m0, int64_t panel, float* out) {
  using namespace jaxattn_dot;
  const int64_t A = p.K / kActGroup, Q = p.K / 4;
  const int8_t* w = static_cast<const int8_t*>(p.w) + panel * Q * 64;
  const float* s = p.scales + panel * p.G * 16;
  float f[R][16] = {};
  for (int64_t a = 0; a < A; ++a) {
    Acc16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Zero();
    for (int64_t q = a * (kActGroup / 4); q < (a + 1) * (kActGroup / 4); ++q) {
      const S8 v = LoadS8(w + q * 64);
      for (int r = 0; r < R; ++r) DotS8(acc[r], v, p.quads[(m0 + r) * Q + q]);
    }
    // One scale per column (G = 1): applied at the end; in groups: with each group's sums.
    const float* sa = p.G == 1 ? nullptr : s + (a * kActGroup / p.group) * 16;
    for (int r = 0; r < R; ++r)
      AddScaled(f[r], acc[r], kS8Bias * p.xsum[(m0 + r) * A + a], sa, p.xs[(m0 + r) * A + a]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 16; ++c) out[(m0 + r) * p.N + panel * 16 + c] = f[r][c] * (p.G == 1 ? s[c] : 1.0f);
}

template <int R>
void Int4Q8Panel(const Problem& p, int64_t m0, int64_t panel, float* out) {
  using namespace jaxattn_dot;
  const int64_t A = p.K / kActGroup, T = p.K / 8;
  const uint32_t* w = static_cast<const uint32_t*>(p.w) + panel * T * 16;
  const float* s = p.scales + panel * p.G * 16;
  const float* mn = p.mins ? p.mins + panel * p.G * 16 : nullptr;
  float f[R][16] = {};
  for (int64_t a = 0; a < A; ++a) {
    Acc16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Zero();
    for (int64_t t = a * 4; t < a * 4 + 4; ++t) {
      const U4 v = LoadU4(w + t * 16);
      for (int r = 0; r < R; ++r) DotU4(acc[r], v, p.even[(m0 + r) * T + t], p.odd[(m0 + r) * T + t]);
    }
    const int64_t g = a * kActGroup / p.group;
    for (int r = 0; r < R; ++r)
      AddScaled4(f[r], acc[r], p.xsum[(m0 + r) * A + a], s + g * 16, mn ? mn + g * 16 : nullptr, p.xs[(m0 + r) * A + a]);
  }
  for (int r = 0; r < R; ++r) std::copy(f[r], f[r] + 16, out + (m0 + r) * p.N + panel * 16);
}

// out[:, j0:j1] (whole panels) for the panels layout: each panel for kPanelRows rows at a time, the
// first pass reading it from memory, the next ones from the cache.
void Panels(const Problem& p, int64_t j0, int64_t j1, float* out) {
  using Kernel = void (*)(const Problem&, int64_t, int64_t, float*);
  static constexpr Kernel int8[] = {Int8Q8Panel<1>, Int8Q8Panel<2>, Int8Q8Panel<3>, Int8Q8Panel<4>};
  static constexpr Kernel int4[] = {Int4Q8Panel<1>, Int4Q8Panel<2>, Int4Q8Panel<3>, Int4Q8Panel<4>};
  for (int64_t panel = j0 / 16; panel < j1 / 16; ++panel)
    for (int64_t m0 = 0; m0 < p.M; m0 += kPanelRows) {
      const int64_t rows = std::min(kPanelRows, p.M - m0);
      (p.bits == 8 ? int8 : int4)[rows - 1](p, m0, panel, out);
    }
}

struct Shared {
  Problem p;
  float* out;
  int64_t chunk_cols, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Takes pieces of columns until none is left; each piece's outputs are written by it alone.
void Work(Shared& s) {
  const Problem& p = s.p;
  std::vector<float> part;
  std::vector<int32_t> isums;
  for (int64_t c; (c = s.next.fetch_add(1)) < s.chunks;) {
    const int64_t j0 = c * s.chunk_cols, j1 = std::min(p.N, j0 + s.chunk_cols);
    if (p.panels) {
      Panels(p, j0, j1, s.out);
      s.done.fetch_add(1);
      continue;
    }
    for (int64_t m0 = 0; m0 < p.M; m0 += kMaxRows) {
      const int64_t m1 = std::min(p.M, m0 + kMaxRows);
      if (p.q8) {
        if (p.bits == 8) {
          isums.resize(kMaxRows * s.chunk_cols);
          Int8Q8(p, m0, m1, j0, j1, s.out, isums.data());
        } else {
          Int4Q8(p, m0, m1, j0, j1, s.out);
        }
        continue;
      }
      part.resize(kMaxRows * s.chunk_cols);
      for (int64_t m = m0; m < m1; ++m) std::fill(s.out + m * p.N + j0, s.out + m * p.N + j1, 0.0f);
      (p.bits == 8 ? Int8Float : Int4Float)(p, m0, m1, j0, j1, s.out, part.data());
    }
    s.done.fetch_add(1);
  }
}

ffi::Error Run(ffi::ThreadPool& pool, const float* x, const void* w, const float* scales, const float* mins, float* out,
               int64_t M, int64_t K, int64_t N, int64_t G, int32_t bits, int32_t q8act, int32_t threads,
               bool panels = false) {
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (q8act && (K % kActGroup != 0 || (K / G) % kActGroup != 0 || (bits == 8 && G != 1 && !panels)))
    return ffi::Error::InvalidArgument("quantized matmul: q8act takes weights in groups of a multiple of 32 rows "
                                       "(int8 in rows: per column), K a multiple of 32");
  auto shared = std::make_shared<Shared>();
  shared->p = Problem{x, w, scales, mins, M, K, N, bits, G, K / G, q8act != 0, panels, {}, {}, {}, {}, {}};
  if (q8act) QuantizeRows(shared->p);
  shared->out = out;
  // A worker for each kMinWeights weights, up to `threads`: waking one costs more than a small product.
  const int64_t workers = std::max<int64_t>(1, std::min(int64_t{threads}, K * N / kMinWeights));
  // Pieces of whole 16s (int8: 64s) of columns, about two a worker, at most kChunkBytes of each row: a piece reads
  // its rows' spans in order, and a long span is what the hardware prefetches well.
  const int64_t unit = bits == 8 ? 64 : 16;  // the vector loops' columns
  const int64_t most = std::max<int64_t>(unit, kChunkBytes / (bits == 4 ? 4 : 1) / unit * unit);
  // Panels: a piece is consecutive whole panels, one stream however many columns, about four a worker.
  const int64_t per_piece = panels ? (N + 4 * workers - 1) / (4 * workers) : (N + 2 * workers - 1) / (2 * workers);
  shared->chunk_cols = panels ? std::max<int64_t>(16, (per_piece + 15) / 16 * 16)
                              : std::min(most, std::max<int64_t>(unit, (per_piece + unit - 1) / unit * unit));
  shared->chunks = (N + shared->chunk_cols - 1) / shared->chunk_cols;
  // Helpers hold the shared state themselves: one that starts after the work is done finds none.
  for (int64_t i = 1; i < std::min(workers, shared->chunks); ++i) pool.Schedule([shared] { Work(*shared); });
  Work(*shared);
  while (shared->done.load() < shared->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error QuantMatmul8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> values,
                        ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> out, int32_t q8act, int32_t threads) {
  const auto xd = x.dimensions(), vd = values.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || vd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("quantized matmul: x [M, K], values [K, N], scales [G, N]");
  const int64_t M = xd[0], K = xd[1], N = vd[1], G = sd[0];
  if (vd[0] != K || sd[1] != N || G < 1 || K % G != 0)
    return ffi::Error::InvalidArgument("quantized matmul: int8 shapes do not match (K a multiple of G)");
  return Run(pool, x.typed_data(), values.typed_data(), scales.typed_data(), nullptr, out->typed_data(), M, K, N, G, 8,
             q8act, threads);
}

// Minimums: an empty buffer (none) or shaped as scales.
const float* Minimums(ffi::Buffer<ffi::F32>& mins) { return mins.element_count() == 0 ? nullptr : mins.typed_data(); }

ffi::Error QuantMatmul4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> values,
                        ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> out,
                        int32_t q8act, int32_t threads) {
  const auto xd = x.dimensions(), vd = values.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || vd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("quantized matmul: x [M, K], values [K / 8, N], scales [G, N]");
  const int64_t M = xd[0], K = xd[1], N = vd[1], G = sd[0];
  if (vd[0] * 8 != K || sd[1] != N || G < 1 || K % G != 0 || (K / G) % 8 != 0)
    return ffi::Error::InvalidArgument("quantized matmul: int4 shapes do not match (groups of a multiple of 8 rows)");
  if (mins.element_count() != 0 && mins.element_count() != scales.element_count())
    return ffi::Error::InvalidArgument("quantized matmul: minimums are shaped as scales (or empty)");
  return Run(pool, x.typed_data(), values.typed_data(), scales.typed_data(), Minimums(mins), out->typed_data(), M, K, N,
             G, 4, q8act, threads);
}

// The panels layout's shapes (see the contract): values [N / 16, K / 4, 64] int8 or [N / 16, K / 8, 16] int32,
// scales [N / 16, G, 16]; q8act only.
template <ffi::DataType V>
ffi::Error QuantMatmulPanels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<V> values,
                             ffi::Buffer<ffi::F32> scales, const float* mins, ffi::ResultBuffer<ffi::F32> out,
                             int32_t threads) {
  constexpr int32_t bits = V == ffi::DataType::S8 ? 8 : 4;
  const auto xd = x.dimensions(), vd = values.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || vd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("quantized matmul (panels): x [M, K], values [N / 16, rows, width], "
                                       "scales [N / 16, G, 16]");
  const int64_t M = xd[0], K = xd[1], N = vd[0] * 16, G = sd[1];
  const bool fits = bits == 8 ? vd[1] * 4 == K && vd[2] == 64 : vd[1] * 8 == K && vd[2] == 16;
  if (!fits || sd[0] != vd[0] || sd[2] != 16 || G < 1 || K % G != 0)
    return ffi::Error::InvalidArgument("quantized matmul (panels): shapes do not match");
  return Run(pool, x.typed_data(), values.typed_data(), scales.typed_data(), mins, out->typed_data(), M, K, N, G, bits,
             1, threads, true);
}

ffi::Error QuantMatmul8Panels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> values,
                              ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> out, int32_t threads) {
  return QuantMatmulPanels<ffi::DataType::S8>(pool, x, values, scales, nullptr, out, threads);
}

ffi::Error QuantMatmul4Panels(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> values,
                              ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins, ffi::ResultBuffer<ffi::F32> out,
                              int32_t threads) {
  if (mins.element_count() != 0 && mins.element_count() != scales.element_count())
    return ffi::Error::InvalidArgument("quantized matmul (panels): minimums are shaped as scales (or empty)");
  return QuantMatmulPanels<ffi::DataType::S32>(pool, x, values, scales, Minimums(mins), out, threads);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnQuantMatmul8Panels, QuantMatmul8Panels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // values [N / 16, K / 4, 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N / 16, G, 16]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnQuantMatmul4Panels, QuantMatmul4Panels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // values [N / 16, K / 8, 16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [N / 16, G, 16]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // minimums as scales, or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnQuantMatmul8, QuantMatmul8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // values [K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [G, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("q8act")
                                  .Attr<int32_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnQuantMatmul4, QuantMatmul4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // values [K / 8, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [G, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // minimums as scales, or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("q8act")
                                  .Attr<int32_t>("threads"));

// The instruction-set path the integer dots were compiled to (quant_dot.h): "avx512vnni", "avxvnni", "avx2",
// "neon-dotprod", "neon" or "scalar".
extern "C" const char* JaxattnQuantMatmulPath() { return jaxattn_dot::kPath; }
