// The native CPU attention's rows on one thread, timed directly in C++ (no XLA in between): a decode batch (48
// sequences of 170-230 keys, one row each, pages shuffled over the pool) and one 256-token prompt (256 causal
// rows of one sequence), with SmolLM-135M's heads (9 query, 3 KV, head_dim 64), fp32 pages of 16 keys.
//
//   g++ -O3 -DNDEBUG -march=native -fopenmp-simd -std=c++17 -I. \
//       -I$(python -c "import jax; print(jax.ffi.include_dir())") \
//       -DKERNEL='"pallas_kernels/ragged_paged_attention/cpu_native.cc"' \
//       scripts/bench_native_attention_rows.cc -o /tmp/attention_rows
//   /tmp/attention_rows
//
// Prints the best of its calls and nanoseconds per (row, visible key) pair, and a sum of the outputs (equal to
// a few units in the last place between versions that only reorder a dot product's terms).
#include KERNEL

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  constexpr int kSeqs = 48, kKvHeads = 3, kGroup = 3, kHeadDim = 64, kPageSize = 16, kQHeads = kKvHeads * kGroup;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  const int width = 270 / kPageSize + 1, num_pages = kSeqs * width + 8;
  std::vector<float> k(static_cast<size_t>(kKvHeads) * num_pages * kPageSize * kHeadDim), v(k.size());
  std::vector<float> q(static_cast<size_t>(256) * kQHeads * kHeadDim);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  for (float& x : q) x = 0.3f * normal(rng);
  std::vector<int32_t> order(num_pages);
  for (int i = 0; i < num_pages; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> tables(order.begin(), order.begin() + kSeqs * width);
  std::vector<int32_t> row_seq(256), first(256), last(256);
  std::vector<float> out(q.size()), lse(256 * kQHeads);
  auto run = [&](int rows, const char* what, int calls) {
    const Call c{Shape{rows, kQHeads, kKvHeads, num_pages, kPageSize, kHeadDim, kSeqs, width}, q.data(), k.data(),
                 v.data(), nullptr, nullptr, tables.data(), row_seq.data(), first.data(), last.data(), 0.125f, 0.0f,
                 out.data(), lse.data()};
    double best = 1e30;
    for (int call = 0; call < calls; ++call) {
      const auto start = std::chrono::steady_clock::now();
      const ffi::Error error = attend_rows<float, kHeadDim>(c, 0, rows);
      const auto end = std::chrono::steady_clock::now();
      if (error.failure()) return std::printf("%s: the kernel failed\n", what), void();
      best = std::min(best, std::chrono::duration<double, std::micro>(end - start).count());
    }
    double sum = 0;
    for (int i = 0; i < rows * kQHeads * kHeadDim; ++i) sum += out[i];
    long pairs = 0;
    for (int r = 0; r < rows; ++r) pairs += last[r] - first[r] + 1;
    std::printf("%-7s %3d rows %6ld pairs: %8.1f us  %6.1f ns a pair  sum %.6f\n", what, rows, pairs, best,
                best * 1e3 / pairs, sum);
  };
  std::uniform_int_distribution<int> length(170, 230);
  for (int r = 0; r < kSeqs; ++r) row_seq[r] = r, first[r] = 0, last[r] = length(rng) - 1;
  run(kSeqs, "decode", 30);
  for (int r = 0; r < 256; ++r) row_seq[r] = 0, first[r] = 0, last[r] = r;
  run(256, "prompt", 10);
}
