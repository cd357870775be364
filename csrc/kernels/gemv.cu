// Skinny GEMM (m <= kGemvMaxRows rows of activations) for decode steps: out[m, n] = x[m, k] @ W[n, k]^T.
// The weight is the only large operand, so the kernel is a weight-streaming loop: each warp owns
// one output column (one row of W; two for the fused gate/up), each lane reads 16 bytes of each
// of its W rows per iteration, kUnroll iterations in flight before the first use, and multiplies them with the
// matching 16 bytes of every x row (x is small and stays in L1/L2). fp32 accumulation, one
// warp-shuffle reduction per output, rounding once to the storage type (as cuBLAS does).
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv.h"
#include "kernels/silu.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kUnroll = 4;

template <typename T>
struct Pack8 {  // 8 elements = 16 bytes for 2-byte types
  using V = Vec<T, 16 / sizeof(T)>;
  static constexpr int kElems = 16 / sizeof(T);
};

// 16 bytes of weight, read once: through the non-coherent path and without allocating in L1,
// which is left to x (re-read by every warp).
template <typename V>
__device__ __forceinline__ V load_streaming(const V* p) {
  static_assert(sizeof(V) == 16, "16-byte vectors only");
  uint32_t r0, r1, r2, r3;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "l"(p));
  V v;
  uint32_t* words = reinterpret_cast<uint32_t*>(&v);
  words[0] = r0;
  words[1] = r1;
  words[2] = r2;
  words[3] = r3;
  return v;
}

// kAct kNone: out [m, n] = x @ weight^T + bias, weight [n, k], one weight row per warp.
// kSilu, kGeluTanh: weight is [2n, k] (gate rows, then up rows); the warp of output j reads rows
// j and n + j and writes out [m, n] = act(x @ gate^T) * (x @ up^T), each product rounded to T
// first, as HF's MLP rounds gate_proj and up_proj outputs. x [m, k] has row stride x_stride.
template <typename T, int kM, GatedAct kAct>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gemv_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                const T* __restrict__ weight, const T* __restrict__ bias, int n, int k) {
  begin_dependent_kernel();
  using V = typename Pack8<T>::V;
  constexpr int kE = Pack8<T>::kElems;
  constexpr int kRowsPerWarp = weight_rows_per_output(kAct);
  const int lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;  // the output column
  if (row0 >= n) return;
  const int chunks = k / kE;  // 16-byte chunks per row

  float acc[kRowsPerWarp][kM];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int i = 0; i < kM; ++i) acc[r][i] = 0.f;

  const V* w_rows[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    w_rows[r] = reinterpret_cast<const V*>(weight + (static_cast<int64_t>(r) * n + row0) * k);
  }

  auto multiply = [&](const V (&w)[kRowsPerWarp], int c) {
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      const V xv = reinterpret_cast<const V*>(x + i * x_stride)[c];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[r][i] += to_float(w[r].v[e]) * to_float(xv.v[e]);
    }
  };

  int c = lane;
  // Main loop: kUnroll chunks of every row loaded before any is used.
  for (; c + (kUnroll - 1) * 32 < chunks; c += kUnroll * 32) {
    V w[kUnroll][kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) w[u][r] = load_streaming(&w_rows[r][c + u * 32]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) multiply(w[u], c + u * 32);
  }
  for (; c < chunks; c += 32) {
    V w[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) w[r] = load_streaming(&w_rows[r][c]);
    multiply(w, c);
  }

#pragma unroll
  for (int i = 0; i < kM; ++i) {
    float sums[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) sums[r] = warp_sum(acc[r][i]);
    if (lane != 0) continue;
    T* dst = out + static_cast<int64_t>(i) * n + row0;
    if constexpr (kAct != GatedAct::kNone) {
      *dst = gated_mul<kAct>(from_float<T>(sums[0]), from_float<T>(sums[1]));
    } else {
      const float b = bias == nullptr ? 0.f : to_float(bias[row0]);
      *dst = from_float<T>(sums[0] + b);
    }
  }
}

// One warp per output column: the most warps in flight for the short matrices of small batches.
template <typename T, int kM, GatedAct kAct>
cudaError_t launch_m(T* out, const T* x, int64_t x_stride, const T* w, const T* bias, int n, int k,
                     cudaStream_t stream) {
  const int blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  launch_dependent(gemv_kernel<T, kM, kAct>, blocks, kWarpsPerBlock * 32, 0, stream, out, x, x_stride, w, bias, n, k);
  return cudaGetLastError();
}

template <GatedAct kAct>
cudaError_t launch(void* out, const void* x, int64_t x_stride, const void* weight, const void* bias,
                   int m, int n, int k, DType dtype, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;  // fp32 goes to cuBLAS (the launcher decides)
    } else {
      auto* o = static_cast<T*>(out);
      auto* xs = static_cast<const T*>(x);
      auto* w = static_cast<const T*>(weight);
      auto* b = static_cast<const T*>(bias);
      switch (m) {
        case 1: return launch_m<T, 1, kAct>(o, xs, x_stride, w, b, n, k, stream);
        case 2: return launch_m<T, 2, kAct>(o, xs, x_stride, w, b, n, k, stream);
        default: return cudaErrorInvalidValue;
      }
    }
  });
}

}  // namespace

cudaError_t gemv(void* out, const void* x, int64_t x_stride, const void* weight, const void* bias,
                 int m, int n, int k, GatedAct act, DType dtype, cudaStream_t stream) {
  return dispatch_gated_act(act, [&](auto act_tag) {
    return launch<decltype(act_tag)::value>(out, x, x_stride, weight, bias, m, n, k, dtype, stream);
  });
}

}  // namespace pagedkv::kernels
