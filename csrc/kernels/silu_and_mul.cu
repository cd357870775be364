// out = silu(gate) * up (or gelu_tanh(gate) * up) with HF's rounding (kernels/silu.cuh), 16-byte
// accesses when aligned.
#include <algorithm>
#include <cstdint>

#include "kernels/silu_and_mul.h"
#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/silu.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kThreads = 256;

// Rows on grid.x (there may be many), kVec-element chunks of a row on grid.y x threads.
template <typename T, int kVec, bool kGeluTanh>
__global__ void __launch_bounds__(kThreads) silu_and_mul_kernel(T* __restrict__ out,
                                                               const T* __restrict__ x,
                                                               int64_t intermediate) {
  begin_dependent_kernel();
  using V = Vec<T, kVec>;
  const int64_t row = blockIdx.x;
  const V* gate = reinterpret_cast<const V*>(x + row * 2 * intermediate);
  const V* up = reinterpret_cast<const V*>(x + row * 2 * intermediate + intermediate);
  V* dst = reinterpret_cast<V*>(out + row * intermediate);
  const int64_t num_vecs = intermediate / kVec;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x; i < num_vecs;
       i += static_cast<int64_t>(gridDim.y) * kThreads) {
    const V g = gate[i];
    const V u = up[i];
    V y;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      y.v[j] = kGeluTanh ? gelu_tanh_mul(g.v[j], u.v[j]) : silu_mul(g.v[j], u.v[j]);
    }
    dst[i] = y;
  }
}

template <bool kGeluTanh>
cudaError_t launch(void* out, const void* x, int64_t rows, int64_t intermediate, DType dtype,
                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = intermediate % kVec == 0 && aligned16(out) && aligned16(x);
    const int64_t num_vecs = intermediate / (vectorized ? kVec : 1);
    const dim3 grid(static_cast<unsigned>(rows),
                    static_cast<unsigned>(std::min<int64_t>(65535, (num_vecs + kThreads - 1) / kThreads)));
    auto* o = static_cast<T*>(out);
    auto* in = static_cast<const T*>(x);
    if (vectorized) {
      launch_dependent(silu_and_mul_kernel<T, kVec, kGeluTanh>, grid, kThreads, 0, stream, o, in, intermediate);
    } else {
      launch_dependent(silu_and_mul_kernel<T, 1, kGeluTanh>, grid, kThreads, 0, stream, o, in, intermediate);
    }
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t silu_and_mul(void* out, const void* x, int64_t rows, int64_t intermediate, bool gelu_tanh,
                         DType dtype, cudaStream_t stream) {
  if (gelu_tanh) return launch<true>(out, x, rows, intermediate, dtype, stream);
  return launch<false>(out, x, rows, intermediate, dtype, stream);
}

}  // namespace pagedkv::kernels
