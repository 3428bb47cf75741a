// Ragged paged attention rows for XLA:CPU, read straight from the page pool (an XLA FFI custom call).
//
// Each query row attends to keys [first, last] (inclusive) of its own sequence, found through that sequence's
// page table: the K/V rows of a page are contiguous ([num_kv_heads, num_pages, page_size, head_dim]), so a
// row reads them in place instead of through a gathered copy, which is what bounds the pure-JAX walk on CPU.
// Online softmax in fp32, one page of keys at a time; every key is loaded once for the whole group of query
// heads that shares its KV head (GQA). Keys outside [first, last] are never read (unused pages may hold NaN).
//
// Contract and Python side: native.py. Built there with the system compiler for the machine it runs on.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Per-call working memory of one row's group of query heads.
struct Scratch {
  std::vector<float> scores, acc, peak, total;  // [group, page_size], [group, head_dim], [group], [group]
};

struct Shape {
  int64_t rows, q_heads, kv_heads, num_pages, page_size, head_dim, slots, table_width;
  int64_t group() const { return q_heads / kv_heads; }
};

// One row's group of query heads over one KV head's keys [first, last]; writes the normalised output and the
// log-sum-exp of the scores (-inf, with a zero output, when nothing is visible).
template <typename T>
ffi::Error attend_group(const Shape& s, const float* q, const T* k_pages, const T* v_pages, const int32_t* table,
                        int64_t head, int32_t first, int32_t last, float sm_scale, float soft_cap, Scratch& scratch,
                        float* out, float* lse) {
  const int64_t g_count = s.group(), d_count = s.head_dim, page_size = s.page_size;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float *scores = scratch.scores.data(), *acc = scratch.acc.data();
  float *peak = scratch.peak.data(), *total = scratch.total.data();
  for (int64_t g = 0; g < g_count; ++g) peak[g] = neg_inf, total[g] = 0.0f;
  std::fill(acc, acc + g_count * d_count, 0.0f);
  for (int64_t start = first - first % page_size; start <= last; start += page_size) {
    const int32_t page = table[start / page_size];
    if (page < 0 || page >= s.num_pages) return ffi::Error::InvalidArgument("page index out of range");
    const int64_t lo = std::max<int64_t>(first, start) - start;
    const int64_t hi = std::min<int64_t>(last, start + page_size - 1) - start + 1;  // keys [lo, hi) of the page
    const int64_t base = (head * s.num_pages + page) * page_size * d_count;
    const T* k = k_pages + base;
    const T* v = v_pages + base;
    for (int64_t g = 0; g < g_count; ++g) {
      const float* qg = q + g * d_count;
      float* sg = scores + g * page_size;
      float block_peak = neg_inf;
      for (int64_t j = lo; j < hi; ++j) {
        const T* kj = k + j * d_count;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < d_count; ++d) dot += qg[d] * to_float(kj[d]);
        dot *= sm_scale;
        if (soft_cap > 0.0f) dot = soft_cap * std::tanh(dot / soft_cap);
        sg[j] = dot;
        block_peak = std::max(block_peak, dot);
      }
      const float new_peak = std::max(peak[g], block_peak);
      const float rescale = std::exp(peak[g] - new_peak);  // exp(-inf) = 0 before the first key
      float block_total = 0.0f;
      for (int64_t j = lo; j < hi; ++j) {
        sg[j] = std::exp(sg[j] - new_peak);
        block_total += sg[j];
      }
      float* ag = acc + g * d_count;
#pragma omp simd
      for (int64_t d = 0; d < d_count; ++d) ag[d] *= rescale;
      for (int64_t j = lo; j < hi; ++j) {
        const T* vj = v + j * d_count;
        const float w = sg[j];
#pragma omp simd
        for (int64_t d = 0; d < d_count; ++d) ag[d] += w * to_float(vj[d]);
      }
      total[g] = total[g] * rescale + block_total;
      peak[g] = new_peak;
    }
  }
  for (int64_t g = 0; g < g_count; ++g) {
    const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
    for (int64_t d = 0; d < d_count; ++d) out[g * d_count + d] = acc[g * d_count + d] * inv;
    lse[g] = total[g] > 0.0f ? peak[g] + std::log(total[g]) : neg_inf;
  }
  return ffi::Error::Success();
}

template <typename T>
ffi::Error attend_rows(const Shape& s, const float* q, const T* k_pages, const T* v_pages, const int32_t* tables,
                       const int32_t* row_seq, const int32_t* first, const int32_t* last, float sm_scale,
                       float soft_cap, float* out, float* lse) {
  const int64_t g_count = s.group(), d_count = s.head_dim;
  Scratch scratch{std::vector<float>(g_count * s.page_size), std::vector<float>(g_count * d_count),
                  std::vector<float>(g_count), std::vector<float>(g_count)};
  for (int64_t r = 0; r < s.rows; ++r) {
    const int32_t seq = row_seq[r];
    if (seq < 0 || seq >= s.slots) return ffi::Error::InvalidArgument("row sequence slot out of range");
    const int32_t lo = std::max(first[r], 0);
    const int32_t hi = std::min<int64_t>(last[r], s.table_width * s.page_size - 1);
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t at = (r * s.q_heads + h * g_count);
      ffi::Error error = attend_group(s, q + at * d_count, k_pages, v_pages, tables + seq * s.table_width, h, lo,
                                      hi, sm_scale, soft_cap, scratch, out + at * d_count, lse + at);
      if (error.failure()) return error;
    }
  }
  return ffi::Error::Success();
}

ffi::Error rows_attention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> row_seq, ffi::Buffer<ffi::S32> first,
                          ffi::Buffer<ffi::S32> last, float sm_scale, float soft_cap,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) return ffi::Error::InvalidArgument("bad ranks");
  const Shape s{qd[0], qd[1], kd[0], kd[1], kd[2], kd[3], td[0], td[1]};
  if (qd[2] != s.head_dim || s.q_heads % s.kv_heads) return ffi::Error::InvalidArgument("bad head shapes");
  if (k_pages.element_type() != v_pages.element_type()) return ffi::Error::InvalidArgument("k/v dtypes differ");
  const int32_t *tb = tables.typed_data(), *rs = row_seq.typed_data(), *f = first.typed_data(),
                *l = last.typed_data();
  float *o = out->typed_data(), *e = lse->typed_data();
  switch (k_pages.element_type()) {
    case ffi::DataType::F32:
      return attend_rows(s, q.typed_data(), static_cast<const float*>(k_pages.untyped_data()),
                         static_cast<const float*>(v_pages.untyped_data()), tb, rs, f,
                         l, sm_scale, soft_cap, o, e);
    case ffi::DataType::BF16:
      return attend_rows(s, q.typed_data(), static_cast<const uint16_t*>(k_pages.untyped_data()),
                         static_cast<const uint16_t*>(v_pages.untyped_data()), tb,
                         rs, f, l, sm_scale, soft_cap, o, e);
    default:
      return ffi::Error::InvalidArgument("pages must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRowsAttention, rows_attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [rows, q_heads, head_dim]
                                  .Arg<ffi::AnyBuffer>()         // k_pages [kv_heads, pages, page_size, head_dim]
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables [slots, width]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_seq [rows]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // first [rows]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // last [rows]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")      // 0: none
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [rows, q_heads, head_dim]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [rows, q_heads]
);
