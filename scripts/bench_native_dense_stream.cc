// The native dense product's panels on one thread, with each call's weight streamed from memory (30 layers' worth
// of weights, one after another, as a decode step reads them), timed directly in C++ (no XLA in between).
//
//   g++ -O3 -DNDEBUG -march=native -fopenmp-simd -std=c++17 -I. \
//       -I$(python -c "import jax; print(jax.ffi.include_dir())") \
//       -DKERNEL='"pallas_kernels/matmul/cpu_native.cc"' scripts/bench_native_dense_stream.cc -o /tmp/dense_stream
//   /tmp/dense_stream
//
// Prints the best of 60 calls for each shape (x f32[M, K] @ w f32[K, N]) and the sum of the last output, which
// must not change between two versions of the kernel (the same products in the same order).
#include KERNEL

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  constexpr int kLayers = 30;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  struct Shape {
    int m, k, n;
  } shapes[] = {{512, 576, 1536}, {512, 1536, 576}, {48, 576, 1536}, {48, 1536, 576}};
  for (const Shape& s : shapes) {
    std::vector<float> x(static_cast<size_t>(s.m) * s.k), w(static_cast<size_t>(s.k) * s.n * kLayers);
    std::vector<float> out(static_cast<size_t>(s.m) * s.n);
    for (float& v : x) v = normal(rng);
    for (float& v : w) v = normal(rng);
    double best = 1e30;
    for (int call = 0; call < 60; ++call) {
      const float* layer = w.data() + static_cast<size_t>(call % kLayers) * s.k * s.n;
      const Call c{s.m, s.k, s.n, x.data(), layer, false, out.data()};
      const auto start = std::chrono::steady_clock::now();
      panels<float>(c, 0, (s.n + kPanel - 1) / kPanel);
      const auto end = std::chrono::steady_clock::now();
      best = std::min(best, std::chrono::duration<double, std::micro>(end - start).count());
    }
    double sum = 0;
    for (float v : out) sum += v;
    std::printf("%4d x %4d x %4d: %8.1f us  %6.1f GFLOP/s  sum %.3f\n", s.m, s.k, s.n, best,
                2.0 * s.m * s.k * s.n / best / 1e3, sum);
  }
}
