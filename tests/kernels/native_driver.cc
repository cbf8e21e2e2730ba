// Checks the quantized matmul's integer dots (jaxattn/kernels/native/quant_dot.h), the paged attention's
// float loops (float_vec.h) and the float matmul's register tiles (float_gemm.h) for the instruction set this file is compiled for against a scalar reference
// computed here, without JAX: compiled natively and cross-compiled for ARM (run under qemu-user) by
// tests/kernels/test_native_paths.py.
//
// For random int8 and int4 panels (fixed seed) of 16 columns and K rows, and rows of int8 activations,
// each path's int32 sums must equal the reference exactly: int8 with every value -128 .. 127 in the
// weights (the extremes included) and activations -127 .. 127 (the kernel's rounding range), int4 with
// every nibble 0 .. 15. The float dots and weighted sums, for lengths around each path's vector widths
// (odd ones included), must equal a double-precision reference within 1e-5 of the sum of the terms'
// magnitudes (only the order of float additions differs); so must every tile of the float matmul (each
// count of rows and vectors, storing and adding, the transposed weight's dots, the plain tails), for
// contraction lengths around the vector widths. Prints each header's path, the cases and the
// largest difference; exits 1 on a mismatch.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "float_gemm.h"
#include "float_vec.h"
#include "quant_dot.h"

namespace {

using namespace jaxattn_dot;

// Rows of a panel's int8 activations as the kernel packs them: quads (4 consecutive rows), and the
// even and odd rows of each 8 (for int4 words).
int32_t Pack(const int8_t* x, int stride) {
  uint32_t word = 0;
  for (int b = 0; b < 4; ++b) word |= static_cast<uint32_t>(static_cast<uint8_t>(x[b * stride])) << (8 * b);
  return static_cast<int32_t>(word);
}

// The largest |path - reference| over one int8 panel of K rows times R rows of x.
int64_t CheckInt8(std::mt19937& rng, int K, int R) {
  std::uniform_int_distribution<int> weight(-128, 127), act(-127, 127);
  std::vector<int8_t> w(K * 16), x(R * K);  // panel layout: byte 4c + i of quad t holds W[4t + i, c]
  for (auto& v : w) v = static_cast<int8_t>(weight(rng));
  for (auto& v : x) v = static_cast<int8_t>(act(rng));
  w[0] = -128, w[1] = 127, x[0] = -127, x[1] = 127;  // the extremes of both operands
  int64_t worst = 0;
  for (int r = 0; r < R; ++r) {
    Acc16 acc = Zero();
    int32_t bias = 0;
    for (int t = 0; t < K / 4; ++t) {
      DotS8(acc, LoadS8(w.data() + 64 * t), Pack(x.data() + r * K + 4 * t, 1));
      for (int i = 0; i < 4; ++i) bias += kS8Bias * x[r * K + 4 * t + i];
    }
    int32_t got[16];
    Lanes(acc, got);
    for (int c = 0; c < 16; ++c) {
      int64_t expected = 0;
      for (int k = 0; k < K; ++k) expected += int64_t{w[(k / 4) * 64 + 4 * c + k % 4]} * x[r * K + k];
      worst = std::max<int64_t>(worst, std::llabs(got[c] - bias - expected));
    }
  }
  return worst;
}

// The largest |path - reference| over one int4 panel (16 words a row of 8 K-rows) times R rows of x.
int64_t CheckInt4(std::mt19937& rng, int K, int R) {
  std::uniform_int_distribution<uint32_t> word(0, 0xFFFFFFFFu);
  std::uniform_int_distribution<int> act(-127, 127);
  std::vector<uint32_t> w(K / 8 * 16);
  std::vector<int8_t> x(R * K);
  for (auto& v : w) v = word(rng);
  for (auto& v : x) v = static_cast<int8_t>(act(rng));
  w[0] = 0xFFFFFFFFu, w[1] = 0;  // every nibble 15, every nibble 0
  int64_t worst = 0;
  for (int r = 0; r < R; ++r) {
    Acc16 acc = Zero();
    for (int t = 0; t < K / 8; ++t) {
      const int8_t* xt = x.data() + r * K + 8 * t;
      DotU4(acc, LoadU4(w.data() + 16 * t), Pack(xt, 2), Pack(xt + 1, 2));
    }
    int32_t got[16];
    Lanes(acc, got);
    for (int c = 0; c < 16; ++c) {
      int64_t expected = 0;
      for (int k = 0; k < K; ++k) expected += int64_t{(w[(k / 8) * 16 + c] >> (4 * (k % 8))) & 15u} * x[r * K + k];
      worst = std::max<int64_t>(worst, std::llabs(got[c] - expected));
    }
  }
  return worst;
}

}  // namespace

// The largest error of Dot and WeightedSum over lengths n and `count` slots of `stride` floats, relative
// to the sum of the terms' magnitudes.
double CheckFloat(std::mt19937& rng, int n, int count) {
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  const int stride = n + 3;  // the values of a slot are not adjacent to the next slot's
  std::vector<float> a(n), b(n), w(count), v(count * stride), acc(n);
  for (auto* x : {&a, &b, &w, &v, &acc})
    for (auto& e : *x) e = value(rng);
  double exact = 0.0, size = 0.0;
  for (int h = 0; h < n; ++h) exact += double(a[h]) * b[h], size += std::fabs(double(a[h]) * b[h]);
  double worst = std::fabs(jaxattn_vec::Dot(a.data(), b.data(), n) - exact) / std::max(size, 1e-30);
  std::vector<double> expected(acc.begin(), acc.end()), sizes(n);
  for (int j = 0; j < count; ++j)
    for (int h = 0; h < n; ++h) {
      expected[h] += double(w[j]) * v[j * stride + h];
      sizes[h] += std::fabs(double(w[j]) * v[j * stride + h]);
    }
  for (int h = 0; h < n; ++h) sizes[h] += std::fabs(acc[h]);
  jaxattn_vec::WeightedSum(acc.data(), w.data(), v.data(), stride, count, n);
  for (int h = 0; h < n; ++h) worst = std::max(worst, std::fabs(acc[h] - expected[h]) / std::max(sizes[h], 1e-30));
  return worst;
}

// The largest error of out (rows x cols, row stride N) against x @ w in double (x rows stride K, w [K, N] or,
// `transposed`, [N, K]), plus `base` where the tile adds, relative to the sum of the terms' magnitudes.
double GemmError(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& base,
                 const std::vector<float>& out, int rows, int cols, int K, int N, bool transposed, bool add) {
  double worst = 0.0;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      double exact = add ? base[r * N + c] : 0.0, size = std::fabs(exact);
      for (int k = 0; k < K; ++k) {
        const double term = double(x[r * K + k]) * (transposed ? w[c * K + k] : w[k * N + c]);
        exact += term, size += std::fabs(term);
      }
      worst = std::max(worst, std::fabs(out[r * N + c] - exact) / std::max(size, 1e-30));
    }
  return worst;
}

// Every tile and tail of float_gemm.h for contraction length K: the worst relative error and the cases run.
double CheckGemm(std::mt19937& rng, int K, int* cases) {
  namespace g = jaxattn_gemm;
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  const int N = g::kVecs * g::kWidth + 5;  // a row stride past the widest tile
  std::vector<float> x(g::kRows * K), w(K * N), base(g::kRows * N), out;
  for (auto* v : {&x, &w, &base})
    for (auto& e : *v) e = value(rng);
  double worst = 0.0;
  for (int rows = 1; rows <= g::kRows; ++rows) {
    for (int vecs = 1; vecs <= g::kVecs; ++vecs)
      for (bool add : {false, true}) {
        out = base;
        g::kRowsTiles[rows - 1][vecs - 1](x.data(), K, K, w.data(), N, out.data(), add, 0);
        worst = std::max(worst, GemmError(x, w, base, out, rows, vecs * g::kWidth, K, N, false, add));
        ++*cases;
      }
    out = base;
    g::RowsTail(x.data(), rows, K, w.data(), N, 5, out.data());
    worst = std::max(worst, GemmError(x, w, base, out, rows, 5, K, N, false, false));
    out = base;  // w read as [N, K]: 4 of its rows per dots tile, then 3 in the tail
    if (rows <= g::kDotsRows) g::kDotsTiles[rows - 1](x.data(), K, w.data(), out.data(), N);
    g::DotsTail(x.data(), rows, K, w.data() + 4 * K, 3, out.data() + 4, N);
    worst = std::max(worst, GemmError(x, w, base, out, rows <= g::kDotsRows ? rows : 0, 7, K, N, true, false));
    *cases += 2;
  }
  return worst;
}

int main() {
  std::mt19937 rng(58);
  int64_t worst = 0, cases = 0;
  for (int K : {32, 96, 160, 4096})  // one group of 32, three, five, a long row
    for (int R : {1, 3, 33}) {
      worst = std::max(worst, CheckInt8(rng, K, R));
      worst = std::max(worst, CheckInt4(rng, K, R));
      cases += 2;
    }
  std::printf("path %s: %lld cases, max |error| %lld\n", kPath, static_cast<long long>(cases),
              static_cast<long long>(worst));
  double float_worst = 0.0;
  int float_cases = 0;
  for (int n : {1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 64, 65, 128, 200})
    for (int count : {0, 1, 5, 16}) {
      float_worst = std::max(float_worst, CheckFloat(rng, n, count));
      ++float_cases;
    }
  const bool floats_ok = float_worst <= 1e-5;
  std::printf("float path %s: %d cases, max relative error %s 1e-5 (%.1e)\n", jaxattn_vec::kPath, float_cases,
              floats_ok ? "within" : "above", float_worst);
  double gemm_worst = 0.0;
  int gemm_cases = 0;
  for (int K : {1, 3, 4, 8, 15, 16, 17, 33, 64, 70})
    gemm_worst = std::max(gemm_worst, CheckGemm(rng, K, &gemm_cases));
  const bool gemm_ok = gemm_worst <= 1e-5;
  std::printf("gemm path %s: %d cases, max relative error %s 1e-5 (%.1e)\n", jaxattn_gemm::kPath, gemm_cases,
              gemm_ok ? "within" : "above", gemm_worst);
  return worst == 0 && floats_ok && gemm_ok ? 0 : 1;
}
