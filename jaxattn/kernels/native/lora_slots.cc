// Adapters in slots, each token row its own (or none), on the CPU: the native part of `slot_delta`'s
// "native_cpu" form (jaxattn/kernels/lora_slots.py, registered with jax.ffi).
//
// Contract (target JaxattnLoraSlots): x [M, K] float32, slots [M] int32 (-1: none), a [S, K, r] float32,
// b [S, r, W] float32, scale [S] float32 -> out [M, W] float32 with
//   out[m] = scale[s] * (x[m] a[s]) b[s]  for s = slots[m] in [0, S),  zeros otherwise,
// equal to the float32 reference up to the order of float additions.
//
// Why by hand: the products are small (rank r of 8 to 64) and a step's rows choose among many slots.
// XLA:CPU has no grouped matmul (it lowers ragged_dot densely, every slot against every row), and the loop
// over segments it runs instead ("segment_cpu") costs a while loop, a sort and scatters per projection, more
// than the arithmetic of a decode step. Here one call groups the rows by slot (a counting sort of M ints),
// then, with the register tiles of the native float matmul (float_gemm.h):
//  1. h [R, r] = each row times its slot's a, times the slot's scale, for the R rows with a slot (sorted);
//  2. out = h b per slot, in pieces of columns the workers (XLA's intra-op pool) take in turn: a piece reads
//     its columns of each used slot's b once, for all that slot's rows.
// Phase 2 waits for phase 1 (pieces of rows taken from the same counter), so every h is written before
// it is read; a worker that starts late finds phase 1 done, or takes what is left of it.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "float_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace g = jaxattn_gemm;

namespace {

constexpr int64_t kRowPiece = 16;  // sorted rows per phase-1 piece
constexpr int64_t kColTiles = 6;  // tiles of columns per phase-2 piece (AVX-512: 288 columns, 18 KiB of b at rank 16)
constexpr int64_t kMinWork = 32 * 1024;  // multiply-adds per worker, at least: waking one costs more below

struct Shared {
  const float *x, *a, *b, *scale;
  float* out;
  int64_t M, K, r, W;
  std::vector<int64_t> order;  // the rows with a slot, sorted by slot (stable)
  std::vector<int64_t> starts;  // slot s's rows: order[starts[s] .. starts[s + 1])
  std::unique_ptr<float[]> h;  // [R, r] by position in `order`
  int64_t col_piece = 0, row_pieces = 0, col_pieces = 0;
  std::atomic<int64_t> next{0}, rows_done{0}, cols_done{0};
};

// out[i][0:V*kWidth] = sum_{k<K} x[i][k] * w[k, 0:V*kWidth] for i < R (w row stride N): float_gemm.h's
// RowsTile, with each row of x and of out where a pointer says (the rows of one slot are anywhere in x).
template <int R, int V>
void RowsTileAt(const float* const* x, int64_t K, const float* w, int64_t N, float* const* out, int64_t col) {
  g::Vec acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) acc[i][v] = g::Zero();
  for (int64_t k = 0; k < K; ++k) {
    g::Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = g::Load(w + k * N + v * g::kWidth);
    for (int i = 0; i < R; ++i) {
      const g::Vec xi = g::Splat(x[i][k]);
      for (int v = 0; v < V; ++v) acc[i][v] = g::Fma(xi, wv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) g::Store(out[i] + col + v * g::kWidth, acc[i][v]);
}

using TileAt = void (*)(const float* const*, int64_t, const float*, int64_t, float* const*, int64_t);

template <int R, int... V>
constexpr auto AtByVecs(std::integer_sequence<int, V...>) {
  return std::array<TileAt, sizeof...(V)>{&RowsTileAt<R, V + 1>...};
}

template <int... R>
constexpr auto AtTable(std::integer_sequence<int, R...>) {
  return std::array<std::array<TileAt, g::kVecs>, sizeof...(R)>{AtByVecs<R + 1>(std::make_integer_sequence<int, g::kVecs>{})...};
}

// kTilesAt[rows - 1][vecs - 1]: the accumulators stay in registers, the tile chosen by what is left.
const auto kTilesAt = AtTable(std::make_integer_sequence<int, g::kRows>{});

// out[i][c0:c1] = x[i] @ w[:, c0:c1] for the `rows` rows the pointers give (w [K, N] row-major).
void GemmAt(const float* const* x, int64_t rows, int64_t K, const float* w, int64_t N, int64_t c0, int64_t c1,
            float* const* out) {
  constexpr int64_t tile = g::kVecs * g::kWidth;
  const int64_t whole = c0 + (c1 - c0) / g::kWidth * g::kWidth;  // past it, fewer columns than a vector
  for (int64_t j = c0; j < whole; j += tile) {
    const int64_t vecs = std::min<int64_t>(g::kVecs, (whole - j) / g::kWidth);
    for (int64_t m0 = 0; m0 < rows; m0 += g::kRows)
      kTilesAt[std::min<int64_t>(g::kRows, rows - m0) - 1][vecs - 1](x + m0, K, w + j, N, out + m0, j);
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = whole; c < c1; ++c) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += x[i][k] * w[k * N + c];
      out[i][c] = sum;
    }
}

// h for the sorted rows [i0, i1): each run of one slot's rows times its a, scaled.
void Down(Shared& s, int64_t i0, int64_t i1) {
  const float* x[kRowPiece];
  float* h[kRowPiece];
  for (int64_t i = i0; i < i1; ++i) x[i - i0] = s.x + s.order[i] * s.K, h[i - i0] = s.h.get() + i * s.r;
  int64_t slot = std::upper_bound(s.starts.begin(), s.starts.end(), i0) - s.starts.begin() - 1;
  for (int64_t i = i0; i < i1; ++slot) {
    const int64_t end = std::min(i1, s.starts[slot + 1]);
    if (end <= i) continue;
    GemmAt(x + (i - i0), end - i, s.K, s.a + slot * s.K * s.r, s.r, 0, s.r, h + (i - i0));
    for (float *v = h[i - i0], *last = v + (end - i) * s.r; v < last; ++v) *v *= s.scale[slot];
    i = end;
  }
}

// out[:, c0:c1] for every row with a slot: h b, a slot's columns of b read once for all its rows.
void Up(Shared& s, int64_t c0, int64_t c1) {
  const int64_t slots = static_cast<int64_t>(s.starts.size()) - 1;
  std::vector<const float*> h(g::kRows);
  std::vector<float*> out(g::kRows);
  for (int64_t slot = 0; slot < slots; ++slot)
    for (int64_t i0 = s.starts[slot]; i0 < s.starts[slot + 1]; i0 += g::kRows) {
      const int64_t rows = std::min<int64_t>(g::kRows, s.starts[slot + 1] - i0);
      for (int64_t i = 0; i < rows; ++i) h[i] = s.h.get() + (i0 + i) * s.r, out[i] = s.out + s.order[i0 + i] * s.W;
      GemmAt(h.data(), rows, s.r, s.b + slot * s.r * s.W, s.W, c0, c1, out.data());
    }
}

// Takes pieces from the one counter: phase 1's rows first, then (once every row piece is done) phase 2's
// columns.
void Work(Shared& s) {
  for (int64_t p; (p = s.next.fetch_add(1)) < s.row_pieces + s.col_pieces;) {
    if (p < s.row_pieces) {
      Down(s, p * kRowPiece, std::min<int64_t>(s.order.size(), (p + 1) * kRowPiece));
      s.rows_done.fetch_add(1);
      continue;
    }
    while (s.rows_done.load() < s.row_pieces) std::this_thread::yield();
    const int64_t c0 = (p - s.row_pieces) * s.col_piece;
    Up(s, c0, std::min(s.W, c0 + s.col_piece));
    s.cols_done.fetch_add(1);
  }
}

// The rows with a slot in [0, S), sorted by slot; the rest of `out` zeroed. False if none has one.
bool Group(Shared& s, const int32_t* slots, int64_t S) {
  s.starts.assign(S + 1, 0);
  for (int64_t m = 0; m < s.M; ++m)
    if (slots[m] >= 0 && slots[m] < S) ++s.starts[slots[m] + 1];
  for (int64_t g = 0; g < S; ++g) s.starts[g + 1] += s.starts[g];
  s.order.resize(s.starts[S]);
  std::vector<int64_t> fill(s.starts.begin(), s.starts.end() - 1);
  for (int64_t m = 0; m < s.M; ++m)
    if (slots[m] >= 0 && slots[m] < S) s.order[fill[slots[m]]++] = m;
    else std::fill(s.out + m * s.W, s.out + (m + 1) * s.W, 0.0f);
  return !s.order.empty();
}

ffi::Error LoraSlots(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> scale,
                     ffi::ResultBuffer<ffi::F32> out, int32_t threads) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions();
  if (xd.size() != 2 || ad.size() != 3 || bd.size() != 3 || ad[1] != xd[1] || bd[0] != ad[0] || bd[1] != ad[2] ||
      slots.element_count() != static_cast<size_t>(xd[0]) || scale.element_count() != static_cast<size_t>(ad[0]))
    return ffi::Error::InvalidArgument("lora slots: x [M, K], slots [M], a [S, K, r], b [S, r, W], scale [S]");
  auto shared = std::make_shared<Shared>();
  Shared& s = *shared;
  s.x = x.typed_data(), s.a = a.typed_data(), s.b = b.typed_data(), s.scale = scale.typed_data();
  s.out = out->typed_data(), s.M = xd[0], s.K = xd[1], s.r = ad[2], s.W = bd[2];
  if (s.M == 0 || s.W == 0) return ffi::Error::Success();
  if (!Group(s, slots.typed_data(), ad[0])) return ffi::Error::Success();
  const int64_t rows = s.order.size();
  if (s.r == 0 || s.K == 0) {
    for (int64_t m : s.order) std::fill(s.out + m * s.W, s.out + (m + 1) * s.W, 0.0f);
    return ffi::Error::Success();
  }
  s.h.reset(new float[rows * s.r]);  // every entry written by phase 1
  s.col_piece = kColTiles * g::kVecs * g::kWidth;
  s.row_pieces = (rows + kRowPiece - 1) / kRowPiece;
  s.col_pieces = (s.W + s.col_piece - 1) / s.col_piece;
  const int64_t work = rows * s.r * (s.K + s.W);
  const int64_t workers = std::max<int64_t>(1, std::min({int64_t{threads}, work / kMinWork, s.col_pieces}));
  // Helpers hold the shared state themselves: one that starts after the work is done finds none.
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([shared] { Work(*shared); });
  Work(s);
  while (s.cols_done.load() < s.col_pieces) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnLoraSlots, LoraSlots,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [M]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a [S, K, r]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b [S, r, W]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [S]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [M, W]
                                  .Attr<int32_t>("threads"));
