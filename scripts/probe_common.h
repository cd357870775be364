// What the diagnostic programs (scripts/read_probe.cu, decode_probe.cu, bulk_probe.cu) share:
// CHECK, their error handling, and random_bits, the source of their inputs.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>

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
