// What the diagnostic programs (lab/read_probe.cu, decode_probe.cu, bulk_probe.cu) share:
// CHECK, their error handling; random_bits, the source of their inputs; median_launch_us, their
// timer.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

// CHECK(cudaCall): print the failing call and its error, then exit.
#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

// Random-looking bits from (index, seed), the same on every run: a multiplicative hash, then two
// xor-shift rounds around a second multiply so that the low bits vary as much as the high.
__device__ __forceinline__ uint32_t random_bits(int64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h;
}

// Median microseconds of one launch: 22 event pairs on `stream`, each around one run(), which
// enqueues `launches` launches back to back (so launch gaps are amortized); the first 2 pairs
// are warm-up.
template <typename Run>
float median_launch_us(Run run, int launches, cudaStream_t stream = nullptr) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int rep = 0; rep < 22; ++rep) {
    CHECK(cudaEventRecord(e0, stream));
    run();
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 2) ms.push_back(t / launches);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return 1e3f * ms[ms.size() / 2];
}
