// Attention of a few queries per row against a paged KV cache, float32, on the CPU: the
// "ragged_cpu" kernel's native part (jaxattn/kernels/native_paged.py, registered with jax.ffi).
//
// Contract (jaxattn/kernels/paged.py's, one key part): queries [R, C, N, H], key_pages and
// value_pages [P, ps, K, H|Hv], block_table [R, Pr] int32, query_positions [R, C] int32 (-1 a padding
// query), sinks [N] (read when has_sinks), out [R, C, N, Hv]. Slot j of row r lives at
// pages[block_table[r, j / ps], j % ps]; it is visible to a query at p iff 0 <= j <= p and, with a
// window W > 0, p - j < W. Logits are scale * q.k, soft-capped by cap > 0 (cap * tanh(x / cap));
// a sink joins its head's denominator without a value. A query that sees nothing gives zeros.
//
// Why by hand: XLA:CPU runs this shape (one query row per head group against a few hundred
// slots) as many tiny batched dots, at about a fifth of the memory bandwidth (docs/performance.md
// §14). Here each key and value vector is read once per row and kv head, and used by the G query
// heads that share it, a page of slots at a time with an online softmax. The queries are shared out
// among up to `threads` workers of XLA's intra-op thread pool (the call's own thread first). The dots
// and the weighted sums of values run float_vec.h's path for this CPU (`JaxattnPagedAttentionPath`).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "float_vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shape {
  int64_t R, C, N, H, Hv, P, ps, K, Pr;
};

// One query column of one row, all N heads: an online softmax over the slots it sees, a page at a
// time. Each slot's keys and values for the K heads are one contiguous run, read once for the N
// query heads. `seen[n]` stands for "the running max is not -inf" (no infinities are relied on: the
// file is compiled with -ffast-math, so that the exponentials vectorize).
void AttendQuery(const Shape& s, const float* q, const float* kp, const float* vp, const int32_t* table,
                 int32_t position, const float* sinks, float scale, int32_t window, float cap, int64_t r,
                 float* out, std::vector<float>& scratch) {
  const int64_t N = s.N, G = s.N / s.K, H = s.H, Hv = s.Hv, ps = s.ps;
  float* logits = scratch.data();            // [N, ps]
  float* acc = logits + N * ps;              // [N, Hv]
  float* running_max = acc + N * Hv;         // [N]
  float* total = running_max + N;            // [N]
  float* seen = total + N;                   // [N], 1 or 0
  for (int64_t n = 0; n < N; ++n) {
    running_max[n] = sinks ? sinks[n] : 0.0f;  // the sink: seen by every query, no value
    seen[n] = sinks ? 1.0f : 0.0f;
    total[n] = sinks ? 1.0f : 0.0f;
  }
  std::fill(acc, acc + N * Hv, 0.0f);
  if (position >= 0) {
    const int64_t lo = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
    const int64_t hi = std::min<int64_t>(position, s.Pr * ps - 1);
    for (int64_t first = lo - lo % ps; first <= hi; first += ps) {
      const int64_t page = table[r * s.Pr + first / ps];
      const int64_t from = std::max(lo, first) - first, to = std::min(hi, first + ps - 1) - first;
      const int64_t count = to - from + 1;
      const float* keys = kp + (page * ps + from) * s.K * H;    // [count, K, H]
      const float* values = vp + (page * ps + from) * s.K * Hv;  // [count, K, Hv]
      for (int64_t j = 0; j < count; ++j)
        for (int64_t n = 0; n < N; ++n)
          logits[n * ps + j] = jaxattn_vec::Dot(q + n * H, keys + (j * s.K + n / G) * H, H) * scale;
      for (int64_t n = 0; n < N; ++n) {
        float* l = logits + n * ps;
        if (cap > 0.0f)
          for (int64_t j = 0; j < count; ++j) l[j] = cap * std::tanh(l[j] / cap);
        float block_max = l[0];
        for (int64_t j = 1; j < count; ++j) block_max = std::max(block_max, l[j]);
        const float new_max = seen[n] > 0.0f ? std::max(running_max[n], block_max) : block_max;
        const float rescale = seen[n] > 0.0f ? std::exp(running_max[n] - new_max) : 0.0f;
        float sum = 0.0f;
        for (int64_t j = 0; j < count; ++j) {
          l[j] = std::exp(l[j] - new_max);
          sum += l[j];
        }
        float* a = acc + n * Hv;
        for (int64_t h = 0; h < Hv; ++h) a[h] *= rescale;
        jaxattn_vec::WeightedSum(a, l, values + (n / G) * Hv, s.K * Hv, count, Hv);  // a += l . values
        total[n] = total[n] * rescale + sum;
        running_max[n] = new_max;
        seen[n] = 1.0f;
      }
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    const float inverse = total[n] > 0.0f ? 1.0f / total[n] : 0.0f;
    for (int64_t h = 0; h < Hv; ++h) out[n * Hv + h] = acc[n * Hv + h] * inverse;
  }
}

// One call's work, shared with the helpers it schedules on XLA's intra-op pool: each takes the next
// query until none is left. A helper holds the state itself, so one that starts after the call has
// returned finds no query left and touches nothing else.
struct Shared {
  Shape s;
  const float *q, *kp, *vp, *sink_logits;
  const int32_t *table, *positions;
  float* o;
  float scale, cap;
  int32_t window;
  int64_t queries;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void Work(Shared& w) {
  const Shape& s = w.s;
  std::vector<float> scratch;
  for (int64_t rc = w.next.fetch_add(1); rc < w.queries; rc = w.next.fetch_add(1)) {
    if (scratch.empty()) scratch.resize(s.N * (s.ps + s.Hv + 3));
    AttendQuery(s, w.q + rc * s.N * s.H, w.kp, w.vp, w.table, w.positions[rc], w.sink_logits, w.scale, w.window,
                w.cap, rc / s.C, w.o + rc * s.N * s.Hv, scratch);
    w.done.fetch_add(1);
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> queries, ffi::Buffer<ffi::F32> key_pages,
                              ffi::Buffer<ffi::F32> value_pages, ffi::Buffer<ffi::S32> block_table,
                              ffi::Buffer<ffi::S32> query_positions, ffi::Buffer<ffi::F32> sinks,
                              ffi::ResultBuffer<ffi::F32> out, float scale, int32_t window, float cap,
                              int32_t has_sinks, int32_t threads) {
  const auto qd = queries.dimensions(), kd = key_pages.dimensions(), vd = value_pages.dimensions();
  const auto td = block_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: queries, pages [.., .., .., ..], table [R, Pr]");
  const Shape s{qd[0], qd[1], qd[2], qd[3], vd[3], kd[0], kd[1], kd[2], td[1]};
  if (s.K == 0 || s.N % s.K != 0 || kd[3] != s.H)
    return ffi::Error::InvalidArgument("paged attention: N must be a multiple of K, keys' H the queries'");
  const int32_t* table = block_table.typed_data();
  for (int64_t i = 0; i < s.R * s.Pr; ++i)  // a page outside the pool would be read out of bounds
    if (table[i] < 0 || table[i] >= s.P)
      return ffi::Error::InvalidArgument("paged attention: a block table entry is outside the pool");
  auto shared = std::make_shared<Shared>();
  Shared& w = *shared;
  w.s = s;
  w.q = queries.typed_data(), w.kp = key_pages.typed_data(), w.vp = value_pages.typed_data();
  w.sink_logits = has_sinks ? sinks.typed_data() : nullptr;
  w.table = table, w.positions = query_positions.typed_data(), w.o = out->typed_data();
  w.scale = scale, w.cap = cap, w.window = window, w.queries = s.R * s.C;
  // XLA's pool's threads live as long as the process: nothing is started per call.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, w.queries));
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([shared] { Work(*shared); });
  Work(w);
  while (w.done.load() < w.queries) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxattnPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // queries [R, C, N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // key_pages [P, ps, K, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // value_pages [P, ps, K, Hv]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_table [R, Pr]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_positions [R, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [N] (or [1], unread)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [R, C, N, Hv]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window")  // 0: none
                                  .Attr<float>("cap")       // 0: none
                                  .Attr<int32_t>("has_sinks")
                                  .Attr<int32_t>("threads"));

// The instruction-set path of the float loops this library was built with (float_vec.h), for the kernels line.
extern "C" const char* JaxattnPagedAttentionPath() { return jaxattn_vec::kPath; }
