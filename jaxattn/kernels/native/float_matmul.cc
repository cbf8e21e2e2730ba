// A few float32 rows times a float32 weight, on the CPU: the native part of the "native_cpu" matmul
// (jaxattn/kernels/float_matmul.py, registered with jax.ffi).
//
// Contract: x [M, K] float32 and
//  * target JaxattnFloatMatmul: w [K, N] float32, out [M, N] = x @ w;
//  * target JaxattnFloatMatmulT: w [N, K] float32 (a weight stored transposed: the tied embedding read as
//    the head), out [M, N] = x @ w^T.
// Equal to the float32 reference up to the order of float additions.
//
// Why by hand: see float_gemm.h (the register tiles, one path per instruction set). Here the work is cut
// into pieces of columns (a few tiles' widths; for the transposed weight, a few rows of w) that the workers
// (XLA's intra-op thread pool) take in turn; each piece runs every row of x through its columns, a tile of
// columns at a time for all the passes over x's rows, so that a tile's weights come from memory once and
// from the cache for the next passes. Each piece writes its own outputs, so no sums are shared.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "float_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace g = jaxattn_gemm;

namespace {

constexpr int64_t kMinWeights = 64 * 1024;  // weights per worker, at least: waking one costs more below
constexpr int64_t kDotsCols = 4;  // rows of a transposed weight per dots tile
constexpr int64_t kBand = 64;  // rows of w [K, N] per band (measured: 32 and 128 slower on AVX-512)
constexpr int64_t kPieceCols = 2048;  // columns per piece at most: x's rows' sums for them stay in the cache

struct Shared {
  const float* x;
  const float* w;
  float* out;
  int64_t M, K, N;
  bool transposed;
  int64_t piece_cols, pieces;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// out[:, j0:j1] for w [K, N]: bands of kBand rows of w, each swept across the piece's columns a tile at a time
// (every pass of up to kRows rows of x per tile), its sums added to the bands' before. A band reads kBand
// streams of consecutive floats, which the hardware prefetches; one tile's whole column (K rows N floats
// apart, a page each) would not be, and runs at a third of the speed.
void Rows(const Shared& s, int64_t j0, int64_t j1) {
  constexpr int64_t tile = g::kVecs * g::kWidth;
  const int64_t whole = j0 + (j1 - j0) / g::kWidth * g::kWidth;  // past it, fewer columns than a vector
  for (int64_t k0 = 0; k0 < s.K; k0 += kBand) {
    const int64_t band = std::min(kBand, s.K - k0);
    const float* w = s.w + k0 * s.N;
    for (int64_t j = j0; j < whole; j += tile) {
      const int64_t vecs = std::min<int64_t>(g::kVecs, (whole - j) / g::kWidth);
      for (int64_t m0 = 0; m0 < s.M; m0 += g::kRows) {
        const int64_t rows = std::min<int64_t>(g::kRows, s.M - m0);
        const int64_t ahead = m0 == 0 && k0 + 2 * kBand <= s.K ? kBand * s.N : 0;  // the next band, once
        g::kRowsTiles[rows - 1][vecs - 1](s.x + m0 * s.K + k0, s.K, band, w + j, s.N, s.out + m0 * s.N + j, k0 > 0,
                                          ahead);
      }
    }
  }
  if (whole < j1) g::RowsTail(s.x, s.M, s.K, s.w + whole, s.N, j1 - whole, s.out + whole);
}

// out[:, j0:j1] for w [N, K]: each 4 rows of w for every pass of up to kDotsRows rows of x.
void Dots(const Shared& s, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; j += kDotsCols) {
    const float* wj = s.w + j * s.K;
    for (int64_t m0 = 0; m0 < s.M; m0 += g::kDotsRows) {
      const int64_t rows = std::min<int64_t>(g::kDotsRows, s.M - m0);
      if (j + kDotsCols <= j1)
        g::kDotsTiles[rows - 1](s.x + m0 * s.K, s.K, wj, s.out + m0 * s.N + j, s.N);
      else
        g::DotsTail(s.x + m0 * s.K, rows, s.K, wj, j1 - j, s.out + m0 * s.N + j, s.N);
    }
  }
}

// Takes pieces of columns until none is left.
void Work(Shared& s) {
  for (int64_t c; (c = s.next.fetch_add(1)) < s.pieces;) {
    const int64_t j0 = c * s.piece_cols, j1 = std::min(s.N, j0 + s.piece_cols);
    (s.transposed ? Dots : Rows)(s, j0, j1);
    s.done.fetch_add(1);
  }
}

ffi::Error Run(ffi::ThreadPool& pool, const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N,
               bool transposed, int32_t threads) {
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(out, out + M * N, 0.0f);
    return ffi::Error::Success();
  }
  auto shared = std::make_shared<Shared>();
  Shared& s = *shared;
  s.x = x, s.w = w, s.out = out, s.M = M, s.K = K, s.N = N, s.transposed = transposed;
  const int64_t workers = std::max<int64_t>(1, std::min(int64_t{threads}, K * N / kMinWeights));
  // About four pieces a worker (a late worker still finds some), in whole tiles.
  const int64_t unit = transposed ? kDotsCols : g::kVecs * g::kWidth;
  const int64_t per_piece = (N + 4 * workers - 1) / (4 * workers);
  s.piece_cols = std::max(unit, (per_piece + unit - 1) / unit * unit);
  if (!transposed) s.piece_cols = std::min(s.piece_cols, kPieceCols);
  s.pieces = (N + s.piece_cols - 1) / s.piece_cols;
  // Helpers hold the shared state themselves: one that starts after the work is done finds none.
  for (int64_t i = 1; i < std::min(workers, s.pieces); ++i) pool.Schedule([shared] { Work(*shared); });
  Work(s);
  while (s.done.load() < s.pieces) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error FloatMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> out, int32_t threads) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("float matmul: x [M, K], w [K, N]");
  return Run(pool, x.typed_data(), w.typed_data(), out->typed_data(), xd[0], xd[1], wd[1], false, threads);
}

ffi::Error FloatMatmulT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> out, int32_t threads) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("float matmul (transposed): x [M, K], w [N, K]");
  return Run(pool, x.typed_data(), w.typed_data(), out->typed_data(), xd[0], xd[1], wd[0], true, threads);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnFloatMatmul, FloatMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnFloatMatmulT, FloatMatmulT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("threads"));

// The instruction-set path the tiles were compiled to (float_gemm.h): "avx512", "avx2", "neon" or "scalar".
extern "C" const char* JaxattnFloatMatmulPath() { return g::kPath; }
