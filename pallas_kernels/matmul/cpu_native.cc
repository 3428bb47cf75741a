// Dense products for XLA:CPU with few rows: out f32[M, N] = x[M, K] @ w, an XLA FFI custom call.
//
// XLA:CPU runs a product of a few dozen rows (a decode step's) on one thread, at about half the rate a
// blocked kernel reaches on both cores of a small machine (docs/benchmarks.md). This kernel splits the
// product's columns over the calling thread and XLA's intra-op pool. Each task copies a panel of 32 columns of
// the weight into a contiguous f32 buffer (converting bf16, transposing a [N, K] weight), then runs every
// row through it, eight rows at a time, with the 8 x 32 block of sums in registers: the weight is read from
// memory once, and each value of it is used by every row while it sits in the core's cache.
//
// Accumulation is in f32, over k in order, one fused multiply-add per term: each output is the same sum a plain
// loop computes, in the same order (fma rounding), whatever the thread count.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // columns per panel: two vectors of 16 floats
constexpr int64_t kRows = 8;    // rows per register block

inline float bf16_to_f32(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename W>
inline float widen(W v);
template <>
inline float widen<float>(float v) { return v; }
template <>
inline float widen<uint16_t>(uint16_t v) { return bf16_to_f32(v); }

struct Call {
  int64_t m, k, n;
  const float* x;        // f32[m, k] (bf16 rows widened by the caller)
  const void* w;         // [k, n] (transposed = false) or [n, k] (transposed = true)
  bool transposed;
  float* out;            // f32[m, n]
};

// Panels [p0, p1) of the weight (columns [p0 * kPanel, p1 * kPanel)) as f32[p1 - p0][k][kPanel], zero past the
// weight's last column. A [k, n] weight is read a row at a time across all of these panels' columns: a
// contiguous run per row (a panel alone is 128 bytes a row, each row another page, which the prefetchers do not
// follow). A transposed [n, k] weight: rows c0.. of it, each read front to back (one stream per row), written
// across.
template <typename W>
void pack(const Call& call, int64_t p0, int64_t p1, float* panels) {
  const W* w = static_cast<const W*>(call.w);
  const int64_t k = call.k, n = call.n, c0 = p0 * kPanel, cols = std::min(n, p1 * kPanel) - c0;
  if (!call.transposed) {
    constexpr int64_t kAhead = 8;  // rows
    const int64_t bytes = cols * static_cast<int64_t>(sizeof(W));
    for (int64_t i = 0; i < k; ++i) {
      const W* row = w + i * n + c0;
      if (i + kAhead < k) {
        const char* ahead = reinterpret_cast<const char*>(row + kAhead * n);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b);
      }
      for (int64_t p = 0; p < p1 - p0; ++p) {
        float* dst = panels + (p * k + i) * kPanel;
        const W* src = row + p * kPanel;
        const int64_t width = std::min(kPanel, cols - p * kPanel);
        for (int64_t j = 0; j < width; ++j) dst[j] = widen<W>(src[j]);
        for (int64_t j = width; j < kPanel; ++j) dst[j] = 0.0f;
      }
    }
  } else {
    for (int64_t p = 0; p < p1 - p0; ++p) {
      float* panel = panels + p * k * kPanel;
      const int64_t width = std::min(kPanel, cols - p * kPanel);
      if (width < kPanel) std::memset(panel, 0, sizeof(float) * k * kPanel);
      const W* rows = w + (c0 + p * kPanel) * k;
      constexpr int64_t kStep = 16;
      for (int64_t i0 = 0; i0 < k; i0 += kStep) {
        const int64_t i1 = std::min(k, i0 + kStep);
        for (int64_t j = 0; j < width; ++j) {
          const W* row = rows + j * k;
          for (int64_t i = i0; i < i1; ++i) panel[i * kPanel + j] = widen<W>(row[i]);
        }
      }
    }
  }
}

// Rows [r0, r0 + R) of x through one packed panel, into columns [c0, c0 + width) of out.
#if defined(__AVX512F__)
template <int R>
void block(const Call& call, const float* panel, int64_t r0, int64_t c0, int64_t width) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* x = call.x + r0 * call.k;
  const int64_t k = call.k;
  for (int64_t i = 0; i < k; ++i) {
    const __m512 b0 = _mm512_load_ps(panel + i * kPanel), b1 = _mm512_load_ps(panel + i * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k + i]);
      lo[r] = _mm512_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm512_fmadd_ps(a, b1, hi[r]);
    }
  }
  const __mmask16 m0 = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const __mmask16 m1 = width >= 32 ? 0xFFFF : width <= 16 ? 0 : static_cast<__mmask16>((1u << (width - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    float* o = call.out + (r0 + r) * call.n + c0;
    _mm512_mask_storeu_ps(o, m0, lo[r]);
    _mm512_mask_storeu_ps(o + 16, m1, hi[r]);
  }
}
#else
template <int R>
void block(const Call& call, const float* panel, int64_t r0, int64_t c0, int64_t width) {
  float acc[R][kPanel];
  for (int r = 0; r < R; ++r)
#pragma omp simd
    for (int j = 0; j < kPanel; ++j) acc[r][j] = 0.0f;
  const float* x = call.x + r0 * call.k;
  const int64_t k = call.k;
  for (int64_t i = 0; i < k; ++i) {
    const float* b = panel + i * kPanel;
    for (int r = 0; r < R; ++r) {
      const float a = x[r * k + i];
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) acc[r][j] = __builtin_fmaf(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(call.out + (r0 + r) * call.n + c0, acc[r], sizeof(float) * width);
}
#endif

using BlockFn = void (*)(const Call&, const float*, int64_t, int64_t, int64_t);
constexpr BlockFn kBlocks[kRows + 1] = {nullptr, block<1>, block<2>, block<3>, block<4>,
                                        block<5>, block<6>, block<7>, block<8>};

// This thread's panel buffer, at least ``floats`` long, 64-byte aligned, kept between calls: a fresh one would
// be fresh pages to fault in at every call.
float* panel_buffer(int64_t floats) {
  struct Buffer {
    float* data = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (buffer.size < floats) {
    std::free(buffer.data);
    const int64_t bytes = (sizeof(float) * floats + 63) / 64 * 64;
    buffer.data = static_cast<float*>(std::aligned_alloc(64, bytes));
    buffer.size = buffer.data == nullptr ? 0 : floats;
  }
  return buffer.data;
}

// Packed bytes per pass of ``panels`` (a core's L2 holds them while its rows go through them).
constexpr int64_t kPassBytes = 1024 * 1024;

template <typename W>
void panels(const Call& call, int64_t p0, int64_t p1) {
  const int64_t panel_floats = call.k * kPanel;
  const int64_t per_pass = std::max<int64_t>(1, kPassBytes / (panel_floats * static_cast<int64_t>(sizeof(float))));
  float* buffer = panel_buffer(panel_floats * std::min(per_pass, p1 - p0));
  for (int64_t q0 = p0; q0 < p1; q0 += per_pass) {
    const int64_t q1 = std::min(p1, q0 + per_pass);
    pack<W>(call, q0, q1, buffer);
    for (int64_t p = q0; p < q1; ++p) {
      const float* panel = buffer + (p - q0) * panel_floats;
      const int64_t c0 = p * kPanel, width = std::min(kPanel, call.n - c0);
      for (int64_t r0 = 0; r0 < call.m; r0 += kRows) {
        const int64_t rows = std::min(kRows, call.m - r0);
        kBlocks[rows](call, panel, r0, c0, width);
      }
    }
  }
}

using PanelsFn = void (*)(const Call&, int64_t, int64_t);

// Panels split into chunks that the calling thread and up to ``workers - 1`` tasks on XLA's intra-op pool take
// in turn; the caller waits only for chunks already taken, so a busy pool cannot deadlock it.
void run_split(ffi::ThreadPool& pool, const Call& call, PanelsFn fn, int64_t workers) {
  const int64_t count = (call.n + kPanel - 1) / kPanel;
  const int64_t chunks = std::min<int64_t>(count, 4 * workers);
  if (workers <= 1 || chunks <= 1) return fn(call, 0, count);
  struct Work {
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto work = std::make_shared<Work>();
  auto take = [work, call, fn, chunks, count]() {
    for (int64_t c; (c = work->next.fetch_add(1)) < chunks;) {
      fn(call, count * c / chunks, count * (c + 1) / chunks);
      std::lock_guard<std::mutex> lock(work->mutex);
      if (++work->done == chunks) work->finished.notify_all();
    }
  };
  for (int64_t i = 1; i < workers; ++i) pool.Schedule(decltype(take)(take));
  take();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->finished.wait(lock, [&] { return work->done == chunks; });
}

ffi::Error dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, bool transposed, int64_t threads,
                 ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("x and w must be 2-D");
  const int64_t m = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != k) return ffi::Error::InvalidArgument("x and w disagree on k");
  PanelsFn fn;
  switch (w.element_type()) {
    case ffi::DataType::F32: fn = panels<float>; break;
    case ffi::DataType::BF16: fn = panels<uint16_t>; break;
    default: return ffi::Error::InvalidArgument("w must be float32 or bfloat16");
  }
  const Call call{m, k, n, x.typed_data(), w.untyped_data(), transposed, out->typed_data()};
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(call.out, 0, sizeof(float) * m * n);
    return ffi::Error::Success();
  }
  const int64_t pool_threads = std::max<int64_t>(pool.num_threads(), 1);
  run_split(pool, call, fn, threads <= 0 ? pool_threads : std::min<int64_t>(threads, pool_threads));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDense, dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [m, k]
                                  .Arg<ffi::AnyBuffer>()         // w [k, n] f32|bf16, or [n, k] when transposed
                                  .Attr<bool>("transposed")
                                  .Attr<int64_t>("threads")      // at most this many (1: the caller's; 0: the pool's)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [m, n]
);
