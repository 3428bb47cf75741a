// Ragged paged attention rows for XLA:CPU, read straight from the page pool (an XLA FFI custom call).
//
// Each query row attends to keys [first, last] (inclusive) of its own sequence, found through that sequence's
// page table: the K/V rows of a page are contiguous ([num_kv_heads, num_pages, page_size, head_dim]), so a
// row reads them in place instead of through a gathered copy, which is what bounds the pure-JAX walk on CPU.
// Online softmax in fp32, one page of keys at a time; every key is loaded once for the whole group of query
// heads that shares its KV head (GQA). Keys outside [first, last] are never read (unused pages may hold NaN).
// 8-bit pages (int8, float8_e4m3fn, float8_e5m2, or fp8 held as uint8 bit patterns) carry one f32 scale per token and KV head in pages of their
// own ([num_kv_heads, num_pages, page_size, 1]); they are widened to f32 here (fp8 by integer and float arithmetic, see fp8_to_float), and each key's scale applied
// to the key's score and to its value weight, so nothing is dequantized outside the keys a row reads.
//
// Contract and Python side: native.py. Built there with the system compiler for the machine it runs on.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

inline float to_float(int8_t x) { return static_cast<float>(x); }

// The two fp8 formats, as their bit patterns.
struct E4M3 {  // float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN at S.1111.111
  uint8_t bits;
};
struct E5M2 {  // float8_e5m2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE infinities and NaNs
  uint8_t bits;
};

// An fp8 value as f32, in integer and float operations only, so that a loop of them vectorises (a table lookup
// would be a gather, slow on x86). The magnitude bits shifted into f32's exponent and mantissa fields, with the
// exponent rebased (+ 127 - bias), give every normal value; a subnormal (exponent field 0) then reads as
// 2^(1-bias) * (1 + m/2^M) / 2, and twice that less 2^(1-bias) is its value m * 2^(1-bias-M). No f32 subnormal
// is formed on the way, so the thread's denormal mode cannot change the result. The format's NaNs and (e5m2)
// infinities are kept.
template <int kExponentBits>
inline float fp8_to_float(uint8_t b) {
  constexpr int mantissa_bits = 7 - kExponentBits, bias = (1 << (kExponentBits - 1)) - 1;
  constexpr float smallest_normal = 1.0f / (1 << (bias - 1));  // 2^(1 - bias)
  const uint32_t magnitude = b & 0x7Fu;
  const uint32_t normal = (magnitude << (23 - mantissa_bits)) + (static_cast<uint32_t>(127 - bias) << 23);
  float x;
  std::memcpy(&x, &normal, sizeof x);
  const float sub = 2.0f * x - smallest_normal;  // computed always, selected below: no branch in the loop
  uint32_t subnormal;
  std::memcpy(&subnormal, &sub, sizeof sub);
  // Selections as bit masks (all ones where true), so the loop has no control flow and vectorises.
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>((magnitude >> mantissa_bits) == 0);
  uint32_t bits = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  if (kExponentBits == 4) {  // e4m3fn: S.1111.111 is NaN, no infinities
    const uint32_t is_nan = 0u - static_cast<uint32_t>(magnitude == 0x7Fu);
    bits = (0x7FC00000u & is_nan) | (bits & ~is_nan);
  } else {  // e5m2: exponent field 31 is infinity (mantissa 0) or NaN
    const uint32_t is_special = 0u - static_cast<uint32_t>(magnitude >= 0x7Cu);
    const uint32_t special = magnitude == 0x7Cu ? 0x7F800000u : 0x7FC00000u;
    bits = (special & is_special) | (bits & ~is_special);
  }
  bits |= static_cast<uint32_t>(b & 0x80u) << 24;  // the sign
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline float to_float(E4M3 x) { return fp8_to_float<4>(x.bits); }
inline float to_float(E5M2 x) { return fp8_to_float<5>(x.bits); }

// Per-call working memory of one row's query heads: [heads, page_size], [heads, head_dim], then [heads] each.
struct Scratch {
  std::vector<float> scores, acc, peak, total, block_peak, rescale;
};

// exp(x) for x <= 0 (a score less the running peak) to within a few ulp: Cody-Waite range reduction and Cephes'
// expf polynomial, written so that a loop of it vectorises (libm's expf does not); 0 below -87 (expf's underflow).
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// Asks for the cache lines of ``elements`` values from ``data``: a row's pages lie anywhere in the pool, so
// without it each page's first reads wait on memory.
template <typename T>
inline void prefetch(const T* data, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(data);
  for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(T)); offset += 64) {
    __builtin_prefetch(bytes + offset);
  }
}

struct Shape {
  int64_t rows, q_heads, kv_heads, num_pages, page_size, head_dim, slots, table_width;
  int64_t group() const { return q_heads / kv_heads; }
};

// Prefetches the keys from ``position`` to the end of its page (or to ``last``) of one KV head, if any.
template <typename T>
inline void prefetch_page(const Shape& s, const T* k_pages, const T* v_pages, const int32_t* table, int64_t head,
                          int64_t position, int64_t last) {
  if (position > last) return;
  const int32_t page = table[position / s.page_size];
  if (page < 0 || page >= s.num_pages) return;
  const int64_t offset = position % s.page_size;
  const int64_t keys = std::min<int64_t>(last - position + 1, s.page_size - offset);
  const int64_t base = ((head * s.num_pages + page) * s.page_size + offset) * s.head_dim;
  prefetch(k_pages + base, keys * s.head_dim);
  prefetch(v_pages + base, keys * s.head_dim);
}

// One row's query heads over the keys [first, last] of every KV head, all heads at once; writes the normalised
// outputs and the log-sum-exp of the scores (-inf, with a zero output, when nothing is visible).
// Keys are the outer loop and heads the inner one, so the reads of one key's K (or V) rows in every head's pages are
// independent of each other and in flight together: one walk at a time left the core waiting on each page's
// reads (docs/benchmarks.md, two threads ran 1.7x faster). Each query head's arithmetic is as in one walk.
// kHeadDim: head_dim as a constant (the loops over it unroll), or 0 for any head_dim.
// k_scales/v_scales: the pages' per-token scales ([kv_heads, num_pages, page_size]), or null for unscaled pages.
template <typename T, int kHeadDim>
ffi::Error attend_heads(const Shape& s, const float* q, const T* k_pages, const T* v_pages, const float* k_scales,
                        const float* v_scales, const int32_t* table, int64_t first, int64_t last, float sm_scale,
                        float soft_cap, Scratch& scratch, float* out, float* lse) {
  const int64_t n_heads = s.kv_heads, g_count = s.group(), n = s.q_heads;
  const int64_t d_count = kHeadDim ? kHeadDim : s.head_dim;
  const int64_t page_size = s.page_size, head_stride = s.num_pages * page_size * d_count;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float *scores = scratch.scores.data(), *acc = scratch.acc.data();
  float *peak = scratch.peak.data(), *total = scratch.total.data();
  float *block_peak = scratch.block_peak.data(), *rescale = scratch.rescale.data();
  for (int64_t i = 0; i < n; ++i) peak[i] = neg_inf, total[i] = 0.0f;
  std::fill(acc, acc + n * d_count, 0.0f);
  // No page is visited without a visible key (an empty one would rescale by exp(-inf - -inf) = NaN).
  for (int64_t start = first - first % page_size; first <= last && start <= last; start += page_size) {
    const int32_t page = table[start / page_size];
    if (page < 0 || page >= s.num_pages) return ffi::Error::InvalidArgument("page index out of range");
    const int64_t lo = std::max<int64_t>(first, start) - start;
    const int64_t hi = std::min<int64_t>(last, start + page_size - 1) - start + 1;  // keys [lo, hi) of the page
    const int64_t base0 = page * page_size * d_count;  // head h's page: + h * head_stride
    for (int64_t h = 0; h < n_heads; ++h) {  // loads while this one computes
      prefetch_page(s, k_pages, v_pages, table, h, start + page_size, last);
    }
    for (int64_t i = 0; i < n; ++i) block_peak[i] = neg_inf;
    for (int64_t j = lo; j < hi; ++j) {
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t base = base0 + h * head_stride;
        const T* kj = k_pages + base + j * d_count;
        const float key_scale = k_scales ? sm_scale * k_scales[base / d_count + j] : sm_scale;
        for (int64_t g = 0; g < g_count; ++g) {
          const int64_t i = h * g_count + g;
          const float* qi = q + i * d_count;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < d_count; ++d) dot += qi[d] * to_float(kj[d]);
          dot *= key_scale;
          if (soft_cap > 0.0f) dot = soft_cap * std::tanh(dot / soft_cap);
          scores[i * page_size + j] = dot;
          block_peak[i] = std::max(block_peak[i], dot);
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      float* si = scores + i * page_size;
      const float new_peak = std::max(peak[i], block_peak[i]);
      rescale[i] = std::exp(peak[i] - new_peak);  // exp(-inf) = 0 before the first key
      float block_total = 0.0f;
#pragma omp simd reduction(+ : block_total)
      for (int64_t j = lo; j < hi; ++j) {
        si[j] = exp_nonpositive(si[j] - new_peak);
        block_total += si[j];
      }
      float* ai = acc + i * d_count;
#pragma omp simd
      for (int64_t d = 0; d < d_count; ++d) ai[d] *= rescale[i];
      total[i] = total[i] * rescale[i] + block_total;
      peak[i] = new_peak;
    }
    for (int64_t j = lo; j < hi; ++j) {
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t base = base0 + h * head_stride;
        const T* vj = v_pages + base + j * d_count;
        const float value_scale = v_scales ? v_scales[base / d_count + j] : 1.0f;
        for (int64_t g = 0; g < g_count; ++g) {
          const int64_t i = h * g_count + g;
          const float w = v_scales ? scores[i * page_size + j] * value_scale : scores[i * page_size + j];
          float* ai = acc + i * d_count;
#pragma omp simd
          for (int64_t d = 0; d < d_count; ++d) ai[d] += w * to_float(vj[d]);
        }
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const float inv = total[i] > 0.0f ? 1.0f / total[i] : 0.0f;
    for (int64_t d = 0; d < d_count; ++d) out[i * d_count + d] = acc[i * d_count + d] * inv;
    lse[i] = total[i] > 0.0f ? peak[i] + std::log(total[i]) : neg_inf;
  }
  return ffi::Error::Success();
}

// A row's sequence slot and its visible keys [lo, hi], clamped to its page table (hi < lo: none).
struct RowKeys {
  int32_t seq;
  int64_t lo, hi;
};

inline RowKeys row_keys(const Shape& s, const int32_t* row_seq, const int32_t* first, const int32_t* last,
                        int64_t r) {
  return {row_seq[r], std::max<int64_t>(first[r], 0), std::min<int64_t>(last[r], s.table_width * s.page_size - 1)};
}

// One call's operands (pages untyped: their element type picks the instantiation that reads them; scales null
// for unscaled pages).
struct Call {
  Shape s;
  const float* q;
  const void *k_pages, *v_pages;
  const float *k_scales, *v_scales;
  const int32_t *tables, *row_seq, *first, *last;
  float sm_scale, soft_cap;
  float *out, *lse;
};

// Prefetches the first page of every KV head of row ``r``'s keys (a row whose slot is out of range: nothing), so
// that the next row's or tile's reads are in flight while the current one computes.
template <typename T>
inline void prefetch_row(const Call& c, int64_t r) {
  const Shape& s = c.s;
  const RowKeys row = row_keys(s, c.row_seq, c.first, c.last, r);
  if (row.seq < 0 || row.seq >= s.slots) return;
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    prefetch_page(s, static_cast<const T*>(c.k_pages), static_cast<const T*>(c.v_pages),
                  c.tables + row.seq * s.table_width, h, row.lo, row.hi);
  }
}

#if defined(__AVX512F__)
// The same walk for float and bf16 pages with a head_dim of whole vectors (16 floats), in AVX-512 intrinsics, in
// tiles of consecutive rows of one sequence (attend_tile). The scalar form above spends most of its time on one
// horizontal sum per key and query head and on an accumulator row loaded and stored for every key, and reads a
// prompt's keys again for every row. Here a query head's scores for up to 16 keys are 16 vectors of partial
// products folded into one vector of sums by a tree of shuffles (about 2 per key, not 4), and a (row, query head)'s
// accumulator stays in registers over a block of 16 keys. Keys outside [first, last] are still never read. Only
// the order of the terms of a score's dot product differs from the scalar form.

// 16 keys' bf16 or f32 values [d0, d0 + 16) as f32.
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<uint16_t>(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Lane t of the result is the sum of the 16 lanes of p[t].
inline __m512 sum16(__m512 p[16]) {
  __m512 q[8], r[4];
  for (int i = 0; i < 8; ++i) {  // 128-bit lanes 0-1: p[2i]'s partial sums, 2-3: p[2i + 1]'s
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane k: p[4i + k]'s four partial sums
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m512 e = _mm512_add_ps(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
  const __m512 f = _mm512_add_ps(_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
  const __m512 s = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(e), _mm512_castps_pd(f))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(e), _mm512_castps_pd(f))));
  // s[4k + m] is p[4m + k]'s sum.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

// exp_nonpositive on 16 lanes, the same steps.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 value = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ), value);
}

constexpr int64_t kTileRows = 8;  // consecutive rows of one sequence that share each key block's reads

// Per-call state of a tile's rows: [rows, q_heads] running peaks and totals, [rows, q_heads, head_dim] sums.
struct TileScratch {
  std::vector<float> peak, total, acc;
};

// Rows [r0, r1) of one sequence slot, attended together: each block of up to 16 keys of a KV head is read once for
// all the rows and the query heads of its group while it is in cache, where one row at a time reads a prompt's
// keys again for every row. Each row keeps its own visible range (a lane mask) and online softmax. Decode rows,
// one per sequence, are tiles of one row.
template <typename T, int kHeadDim>
ffi::Error attend_tile(const Call& c, int64_t r0, int64_t r1, TileScratch& scratch) {
  constexpr int kChunks = kHeadDim / 16;
  const Shape& s = c.s;
  const int64_t n_heads = s.kv_heads, g_count = s.group(), n = s.q_heads, rows = r1 - r0;
  const int64_t page_size = s.page_size, head_stride = s.num_pages * page_size * kHeadDim;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const T* k_pages = static_cast<const T*>(c.k_pages);
  const T* v_pages = static_cast<const T*>(c.v_pages);
  int64_t row_lo[kTileRows], row_hi[kTileRows], first = std::numeric_limits<int64_t>::max(), last = -1;
  const int32_t seq = c.row_seq[r0];  // every row of a tile reads this slot (attend_tiles)
  for (int64_t r = 0; r < rows; ++r) {
    const RowKeys keys = row_keys(s, c.row_seq, c.first, c.last, r0 + r);
    row_lo[r] = keys.lo, row_hi[r] = keys.hi;
    if (keys.lo <= keys.hi) first = std::min(first, keys.lo), last = std::max(last, keys.hi);
  }
  if (seq < 0 || seq >= s.slots) return ffi::Error::InvalidArgument("row sequence slot out of range");
  const int32_t* table = c.tables + seq * s.table_width;
  float *peak = scratch.peak.data(), *total = scratch.total.data(), *acc = scratch.acc.data();
  std::fill(peak, peak + rows * n, neg_inf);
  std::fill(total, total + rows * n, 0.0f);
  std::fill(acc, acc + rows * n * kHeadDim, 0.0f);
  const __m512 scale = _mm512_set1_ps(c.sm_scale), minus_inf = _mm512_set1_ps(neg_inf);
  alignas(64) float weights[16];
  // No page is visited without a visible key (an empty one would rescale by exp(-inf - -inf) = NaN).
  for (int64_t start = first - first % page_size; first <= last && start <= last; start += page_size) {
    const int32_t page = table[start / page_size];
    if (page < 0 || page >= s.num_pages) return ffi::Error::InvalidArgument("page index out of range");
    const int64_t lo = std::max<int64_t>(first, start) - start;
    const int64_t hi = std::min<int64_t>(last, start + page_size - 1) - start + 1;  // keys [lo, hi) of the page
    for (int64_t h = 0; h < n_heads; ++h) {  // loads while this one computes
      prefetch_page(s, k_pages, v_pages, table, h, start + page_size, last);
    }
    for (int64_t j0 = lo; j0 < hi; j0 += 16) {
      const int64_t count = std::min<int64_t>(16, hi - j0), position = start + j0;
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t base = (h * s.num_pages + page) * page_size * kHeadDim + j0 * kHeadDim;
        const T* keys = k_pages + base;
        const T* values = v_pages + base;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t a = std::max<int64_t>(row_lo[r] - position, 0);  // this row's keys: lanes [a, b)
          const int64_t b = std::min<int64_t>(row_hi[r] - position + 1, count);
          if (a >= b) continue;
          const __mmask16 valid = static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
          for (int64_t g = 0; g < g_count; ++g) {
            const int64_t i = h * g_count + g, state = r * n + i;
            const float* qi = c.q + ((r0 + r) * n + i) * kHeadDim;
            __m512 qv[kChunks];
            for (int k = 0; k < kChunks; ++k) qv[k] = _mm512_loadu_ps(qi + 16 * k);
            __m512 p[16];
            for (int t = 0; t < 16; ++t) {
              if (t < a || t >= b) {
                p[t] = _mm512_setzero_ps();
                continue;
              }
              const T* kt = keys + t * kHeadDim;
              __m512 sum = _mm512_mul_ps(qv[0], load16<T>(kt));
              for (int k = 1; k < kChunks; ++k) sum = _mm512_fmadd_ps(qv[k], load16<T>(kt + 16 * k), sum);
              p[t] = sum;
            }
            __m512 dots = _mm512_mul_ps(sum16(p), scale);
            if (c.soft_cap > 0.0f) {
              _mm512_store_ps(weights, dots);
              for (int64_t t = a; t < b; ++t) weights[t] = c.soft_cap * std::tanh(weights[t] / c.soft_cap);
              dots = _mm512_load_ps(weights);
            }
            dots = _mm512_mask_blend_ps(valid, minus_inf, dots);
            const float new_peak = std::max(peak[state], _mm512_reduce_max_ps(dots));
            const float rescale = std::exp(peak[state] - new_peak);  // exp(-inf) = 0 before the first key
            const __m512 e = exp_nonpositive16(_mm512_sub_ps(dots, _mm512_set1_ps(new_peak)));
            total[state] = total[state] * rescale + _mm512_reduce_add_ps(e);
            peak[state] = new_peak;
            _mm512_store_ps(weights, e);
            float* ai = acc + state * kHeadDim;
            const __m512 rv = _mm512_set1_ps(rescale);
            __m512 sums[kChunks];
            for (int k = 0; k < kChunks; ++k) sums[k] = _mm512_mul_ps(_mm512_loadu_ps(ai + 16 * k), rv);
            for (int64_t t = a; t < b; ++t) {
              const __m512 w = _mm512_set1_ps(weights[t]);
              const T* vt = values + t * kHeadDim;
              for (int k = 0; k < kChunks; ++k) sums[k] = _mm512_fmadd_ps(w, load16<T>(vt + 16 * k), sums[k]);
            }
            for (int k = 0; k < kChunks; ++k) _mm512_storeu_ps(ai + 16 * k, sums[k]);
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = c.out + (r0 + r) * n * kHeadDim;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t state = r * n + i;
      const float inv = total[state] > 0.0f ? 1.0f / total[state] : 0.0f;
      for (int64_t d = 0; d < kHeadDim; ++d) o[i * kHeadDim + d] = acc[state * kHeadDim + d] * inv;
      c.lse[(r0 + r) * n + i] = total[state] > 0.0f ? peak[state] + std::log(total[state]) : neg_inf;
    }
  }
  return ffi::Error::Success();
}

// Rows [r0, r1) of a call, in tiles of consecutive rows of one sequence.
template <typename T, int kHeadDim>
ffi::Error attend_tiles(const Call& c, int64_t r0, int64_t r1) {
  const Shape& s = c.s;
  TileScratch scratch{std::vector<float>(kTileRows * s.q_heads), std::vector<float>(kTileRows * s.q_heads),
                      std::vector<float>(kTileRows * s.q_heads * kHeadDim)};
  for (int64_t r = r0; r < r1;) {
    int64_t end = r + 1;
    while (end < r1 && end - r < kTileRows && c.row_seq[end] == c.row_seq[r]) ++end;
    if (end < r1) prefetch_row<T>(c, end);  // the next tile's first pages load during this one
    ffi::Error error = attend_tile<T, kHeadDim>(c, r, end, scratch);
    if (error.failure()) return error;
    r = end;
  }
  return ffi::Error::Success();
}
#endif

// Rows [r0, r1) of a call.
template <typename T, int kHeadDim>
ffi::Error attend_rows(const Call& c, int64_t r0, int64_t r1) {
#if defined(__AVX512F__)
  if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) && kHeadDim > 0 && kHeadDim % 16 == 0) {
    return attend_tiles<T, kHeadDim>(c, r0, r1);
  }
#endif
  const Shape& s = c.s;
  const T* k_pages = static_cast<const T*>(c.k_pages);
  const T* v_pages = static_cast<const T*>(c.v_pages);
  const int64_t n = s.q_heads, d_count = s.head_dim;
  Scratch scratch{std::vector<float>(n * s.page_size), std::vector<float>(n * d_count), std::vector<float>(n),
                  std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (int64_t r = r0; r < r1; ++r) {
    const RowKeys row = row_keys(s, c.row_seq, c.first, c.last, r);
    if (row.seq < 0 || row.seq >= s.slots) return ffi::Error::InvalidArgument("row sequence slot out of range");
    const int32_t* table = c.tables + row.seq * s.table_width;
    if (r + 1 < r1) prefetch_row<T>(c, r + 1);  // the next row's first pages load during this row's walk
    const int64_t at = r * s.q_heads;
    ffi::Error error = attend_heads<T, kHeadDim>(s, c.q + at * d_count, k_pages, v_pages, c.k_scales, c.v_scales,
                                                 table, row.lo, row.hi, c.sm_scale, c.soft_cap, scratch,
                                                 c.out + at * d_count, c.lse + at);
    if (error.failure()) return error;
  }
  return ffi::Error::Success();
}

using RowsFn = ffi::Error (*)(const Call&, int64_t, int64_t);

// The instantiation for a page type: the common head dims with their loops unrolled, any other generic.
template <typename T>
RowsFn rows_fn(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend_rows<T, 32>;
    case 64: return attend_rows<T, 64>;
    case 128: return attend_rows<T, 128>;
    case 256: return attend_rows<T, 256>;
    default: return attend_rows<T, 0>;
  }
}

// Rows split into chunks that the calling thread and up to ``workers - 1`` tasks on XLA's intra-op pool take
// in turn. The caller takes chunks until none is left and then waits only for chunks already running, so a
// pool whose threads are all busy (or blocked in the same wait) cannot deadlock it; a task that starts late
// finds nothing to do and touches only the shared state.
ffi::Error run_split(ffi::ThreadPool& pool, const Call& call, RowsFn fn, int64_t workers) {
  const int64_t chunks = std::min<int64_t>(call.s.rows, 4 * workers);
  if (workers <= 1 || chunks <= 1) return fn(call, 0, call.s.rows);
  struct Work {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable finished;
    std::string error;
  };
  auto work = std::make_shared<Work>();
  auto take = [work, call, fn, chunks]() {
    for (int64_t c; (c = work->next.fetch_add(1)) < chunks;) {
      ffi::Error error = fn(call, call.s.rows * c / chunks, call.s.rows * (c + 1) / chunks);
      std::lock_guard<std::mutex> lock(work->mutex);
      if (error.failure() && work->error.empty()) work->error = error.message();
      if (++work->done == chunks) work->finished.notify_all();
    }
  };
  for (int64_t i = 1; i < workers; ++i) pool.Schedule(decltype(take)(take));
  take();
  std::unique_lock<std::mutex> lock(work->mutex);
  work->finished.wait(lock, [&] { return work->done == chunks; });
  return work->error.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(work->error);
}

ffi::Error rows_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> row_seq,
                          ffi::Buffer<ffi::S32> first, ffi::Buffer<ffi::S32> last, float sm_scale, float soft_cap,
                          int64_t threads, int64_t fp8_bytes, ffi::ResultBuffer<ffi::F32> out,
                          ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) return ffi::Error::InvalidArgument("bad ranks");
  const Shape s{qd[0], qd[1], kd[0], kd[1], kd[2], kd[3], td[0], td[1]};
  if (qd[2] != s.head_dim || s.q_heads % s.kv_heads) return ffi::Error::InvalidArgument("bad head shapes");
  if (k_pages.element_type() != v_pages.element_type()) return ffi::Error::InvalidArgument("k/v dtypes differ");
  RowsFn fn;
  bool scaled = true;
  switch (k_pages.element_type()) {
    case ffi::DataType::F32: fn = rows_fn<float>(s.head_dim), scaled = false; break;
    case ffi::DataType::BF16: fn = rows_fn<uint16_t>(s.head_dim), scaled = false; break;
    case ffi::DataType::S8: fn = rows_fn<int8_t>(s.head_dim); break;
    case ffi::DataType::F8E4M3FN: fn = rows_fn<E4M3>(s.head_dim); break;
    case ffi::DataType::F8E5M2: fn = rows_fn<E5M2>(s.head_dim); break;
    case ffi::DataType::U8:  // fp8 bit patterns held as bytes; fp8_bytes names the format
      if (fp8_bytes == 4) {
        fn = rows_fn<E4M3>(s.head_dim);
      } else if (fp8_bytes == 5) {
        fn = rows_fn<E5M2>(s.head_dim);
      } else {
        return ffi::Error::InvalidArgument("uint8 pages need fp8_bytes 4 (float8_e4m3fn) or 5 (float8_e5m2)");
      }
      break;
    default: return ffi::Error::InvalidArgument("pages must be float32, bfloat16, int8, float8_e4m3fn or float8_e5m2");
  }
  // 8-bit pages need their scales (one per token and KV head); float pages take none (empty operands).
  const int64_t scale_count = scaled ? s.kv_heads * s.num_pages * s.page_size : 0;
  if (k_scales.element_count() != static_cast<size_t>(scale_count) ||
      v_scales.element_count() != static_cast<size_t>(scale_count)) {
    return ffi::Error::InvalidArgument("scales must be [kv_heads, pages, page_size, 1] for 8-bit pages, else empty");
  }
  const Call call{s, q.typed_data(), k_pages.untyped_data(), v_pages.untyped_data(),
                  scaled ? k_scales.typed_data() : nullptr, scaled ? v_scales.typed_data() : nullptr,
                  tables.typed_data(),
                  row_seq.typed_data(), first.typed_data(), last.typed_data(), sm_scale, soft_cap,
                  out->typed_data(), lse->typed_data()};
  const int64_t pool_threads = std::max<int64_t>(pool.num_threads(), 1);
  return run_split(pool, call, fn, threads <= 0 ? pool_threads : std::min<int64_t>(threads, pool_threads));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRowsAttention, rows_attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [rows, q_heads, head_dim]
                                  .Arg<ffi::AnyBuffer>()         // k_pages [kv_heads, pages, page_size, head_dim]
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scales [kv_heads, pages, page_size, 1] | [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables [slots, width]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_seq [rows]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // first [rows]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // last [rows]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")      // 0: none
                                  .Attr<int64_t>("threads")     // at most this many (1: the caller's; 0: the pool's)
                                  .Attr<int64_t>("fp8_bytes")   // uint8 pages: 4 e4m3fn, 5 e5m2 bit patterns
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [rows, q_heads, head_dim]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse [rows, q_heads]
);
