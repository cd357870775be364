// Small device helpers shared by the kernels: fp32 conversions of the storage types, 16-byte
// vectors, and warp/block sums.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/alignment.h"
#include "kernels/dtype.h"

namespace pagedkv::kernels {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N elements loaded or stored as one access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sum over all threads of the block; every thread gets the result. blockDim.x % 32 == 0.
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float warp_partials[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  x = warp_sum(x);
  if (lane == 0) warp_partials[warp] = x;
  __syncthreads();
  const int num_warps = blockDim.x / 32;
  x = lane < num_warps ? warp_partials[lane] : 0.f;
  x = warp_sum(x);
  __syncthreads();  // warp_partials may be reused by a later block_sum
  return x;
}

// 16 bytes read once per call (a K/V row piece of paged decode attention): skips L1
// (no_allocate), and a miss asks L2 for the whole 256-byte window around it (a token's row of one
// kv head at head_dim 128, bf16). lab/read_probe.cu times loads through it too.
__device__ __forceinline__ uint4 load16_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Runs `body.template operator()<T>()` with T the CUDA type of `dtype`.
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& body) {
  switch (dtype) {
    case DType::kFloat32: return body(float{});
    case DType::kFloat16: return body(__half{});
    case DType::kBFloat16: return body(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedkv::kernels
