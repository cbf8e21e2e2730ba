// A few float32 rows times an int8 or packed-int4 weight, float32 out, on the CPU: the
// "native_cpu" quantized matmul's native part (jaxattn/kernels/quant_matmul.py, registered with
// jax.ffi).
//
// Contract (jaxattn.quantization.dequantize, then x @ W): x [M, K] float32; values [K, N] int8
// (bits 8) or [K / 2, N] int8 (bits 4: rows 2i and 2i + 1 in the low and high nibble of row i,
// each a signed value in [-8, 7]); scales [G, N] float32, G = 1 (one scale per output column) or
// G = K / group (one per group of `group` input rows and column); out [M, N] = x @ (values * scales).
//
// Why by hand: XLA:CPU converts the int8 weight to float32 in a separate pass before its dot, so it
// reads and writes a float32 copy of the weight on every call. Here W is read once, whole rows in
// order (one stream through memory): each row's values are converted to float32 as they are used and
// x[m, k] * W[k, :] is added into M rows of float32 sums; a column's scale is applied once per group
// (or once at the end, per channel). The rows are cut into pieces of whole groups that the workers
// (XLA's intra-op thread pool, a worker per kMinWeights weights) take in turn, each into its own
// sums, added up at the end: the sums' order differs from the reference's only by float32 rounding.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunkBytes = 64 * 1024;  // bytes of weight per piece of work, about
constexpr int64_t kMinWeights = 256 * 1024;  // weights per worker, at least

struct Problem {
  const float* x;
  const int8_t* w;
  const float* scales;
  int64_t M, K, N, bits, G;
  int64_t group;  // input rows per scale; K when G == 1 (the scales are then applied once, at the end)
};

// acc[M, N] += x[:, k0:k1] @ values[k0:k1, :] (scaled per group when G > 1; part: M * N scratch).
// The weight rows are read in order, whole: one stream through memory; each row's values are converted
// to float32 as they are used (int4: two rows from one row of bytes) and added into M rows of sums.
void Rows(const Problem& p, int64_t k0, int64_t k1, float* acc, float* part, float* low, float* high) {
  const int64_t N = p.N;
  const int64_t span = p.G == 1 ? k1 - k0 : p.group;
  for (int64_t g0 = k0; g0 < k1; g0 += span) {
    float* __restrict sums = p.G == 1 ? acc : part;
    if (p.G != 1) std::fill(part, part + p.M * N, 0.0f);
    for (int64_t k = g0; k < g0 + span; k += (p.bits == 4 ? 2 : 1)) {
      if (p.bits == 8) {
        const int8_t* __restrict src = p.w + k * N;
        for (int64_t m = 0; m < p.M; ++m) {
          const float xk = p.x[m * p.K + k];
          float* __restrict a = sums + m * N;
          for (int64_t j = 0; j < N; ++j) a[j] += xk * static_cast<float>(src[j]);
        }
      } else {
        const int8_t* __restrict src = p.w + (k / 2) * N;
        for (int64_t j = 0; j < N; ++j) {
          const int32_t v = src[j];  // the high nibble is v >> 4 (sign-extended); the low one ((v & 15) ^ 8) - 8
          low[j] = static_cast<float>(((v & 15) ^ 8) - 8);
          high[j] = static_cast<float>(v >> 4);
        }
        for (int64_t m = 0; m < p.M; ++m) {
          const float x0 = p.x[m * p.K + k], x1 = p.x[m * p.K + k + 1];
          float* __restrict a = sums + m * N;
          for (int64_t j = 0; j < N; ++j) a[j] += x0 * low[j] + x1 * high[j];
        }
      }
    }
    if (p.G != 1) {
      const float* __restrict s = p.scales + (g0 / p.group) * N;
      for (int64_t m = 0; m < p.M; ++m)
        for (int64_t j = 0; j < N; ++j) acc[m * N + j] += part[m * N + j] * s[j];
    }
  }
}

struct Shared {
  Problem p;
  int64_t chunk_rows, chunks;
  std::vector<std::vector<float>> sums;  // per worker: its [M, N] partial sums (empty: it took no work)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Worker w takes pieces of rows until none is left, summing them into its own sums[w].
void Work(Shared& s, int64_t w) {
  const Problem& p = s.p;
  std::vector<float> part, low, high;
  for (int64_t c; (c = s.next.fetch_add(1)) < s.chunks;) {
    if (s.sums[w].empty()) {
      s.sums[w].assign(p.M * p.N, 0.0f);
      if (p.G != 1) part.resize(p.M * p.N);
      if (p.bits == 4) low.resize(p.N), high.resize(p.N);
    }
    const int64_t k0 = c * s.chunk_rows;
    Rows(p, k0, std::min(p.K, k0 + s.chunk_rows), s.sums[w].data(), part.data(), low.data(), high.data());
    s.done.fetch_add(1);
  }
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> values,
                           ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> out, int32_t bits,
                           int32_t threads) {
  const auto xd = x.dimensions(), vd = values.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || vd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("quantized matmul: x [M, K], values [K | K / 2, N], scales [G, N]");
  const int64_t M = xd[0], K = xd[1], N = vd[1], G = sd[0];
  if ((bits != 8 && bits != 4) || vd[0] * (bits == 4 ? 2 : 1) != K || sd[1] != N || G < 1 || K % G != 0 ||
      (bits == 4 && (K / G) % 2 != 0))
    return ffi::Error::InvalidArgument("quantized matmul: shapes do not match (bits 8 or 4, K a multiple of G)");
  float* o = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  auto shared = std::make_shared<Shared>();
  shared->p = Problem{x.typed_data(), values.typed_data(), scales.typed_data(), M, K, N, bits, G, K / G};
  // Pieces of about kChunkBytes, whole groups (whole row pairs for int4).
  const int64_t unit = G == 1 ? (bits == 4 ? 2 : 1) : K / G;
  const int64_t row_bytes = N * (bits == 4 ? 1 : 2) / 2;
  const int64_t units = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, row_bytes * unit));
  shared->chunk_rows = std::min(K, units * unit);
  shared->chunks = (K + shared->chunk_rows - 1) / shared->chunk_rows;
  // A worker for each kMinWeights weights, up to `threads`: waking one costs more than a small weight's product.
  const int64_t workers = std::max<int64_t>(1, std::min({int64_t{threads}, K * N / kMinWeights, shared->chunks}));
  shared->sums.resize(workers);
  // Helpers hold the shared state themselves: one that starts after the work is done finds none.
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([shared, w] { Work(*shared, w); });
  Work(*shared, 0);
  while (shared->done.load() < shared->chunks) std::this_thread::yield();
  std::fill(o, o + M * N, 0.0f);
  for (const auto& sums : shared->sums)
    if (!sums.empty())
      for (int64_t i = 0; i < M * N; ++i) o[i] += sums[i];
  if (G == 1)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < N; ++j) o[m * N + j] *= shared->p.scales[j];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // values [K, N] or [K / 2, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [G, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, N]
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("threads"));
