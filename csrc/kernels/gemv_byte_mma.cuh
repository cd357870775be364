// The tensor-core skinny GEMM of one-byte weight formats (FP8 e4m3 block-scaled, LLM.int8 row-
// scaled) for 1..8 rows of x: out^T[n, m] = W[n, k] x^T with mma.sync.m16n8k16, W = byte values
// times an fp32 scale that is constant over each 64-k step of a row.
//
// Why: the CUDA-core skeleton (gemv_dequant.cuh) does one FMA per weight per row of x, so at 8 rows
// the SMs run out of issue slots (FP8: 27% of the memory bandwidth on the W1 shape). Here the
// tensor cores do the multiply-adds whatever the rows, on the bytes converted exactly to x's
// 16-bit type. The scale multiplies fp32 partial sums, never a weight: each 64-k step's mma
// partial is scaled per output row and added, the rounding of the CUDA-core kernel
// (kScalePartial there).
//
// Fragment order (see gemv_mma.cu / gemv_4bit_mma.cu): lane (g = lane / 4, t = lane % 4) loads the
// 16 bytes = 16 k of weight rows g and g + 8 at k0 = 64 step + 16 t. Word j of the piece holds
// k0 + 4j .. 4j + 3: its low half converts to the A register of pair (4j, 4j + 1), its high half to
// (4j + 2, 4j + 3), and the matching B registers are x's words as loaded. One mma per word.
//
// The format policy F:
//   template <typename T> static uint32_t pair_to(uint32_t two);  bytes 0-1 of `two` -> two T
//   const float* row_scales(int row) const;                    the row's scales
//   float step_scale(const float* row_scales, int step, int k) const;  the 64-k step's scale
#pragma once
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/dtype.h"
#include "kernels/gemv_split_k.cuh"
#include "kernels/mma.cuh"

namespace pagedkv::kernels::gemv_byte_mma {

constexpr int kSplit = 8;    // warps per CTA sharing one 16-row tile's k range (as gemv_4bit_mma)
constexpr int kUnroll = 4;   // 64-k steps loaded per warp before the first mma
constexpr int kStepK = 64;   // k per step: 4 lanes (t) x 16 bytes

// out [m, n] = x [m, k] @ W^T. weight: [n, k / 16] 16-byte pieces, k % 16 == 0.
template <typename T, typename F>
__global__ void __launch_bounds__(kSplit * 32)
    gemv_byte_mma_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                         const uint4* __restrict__ weight, const F format, int m, int n, int k) {
  begin_dependent_kernel();
  __shared__ float partial[kSplit - 1][4][32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int tile = blockIdx.x;
  const int pieces = k / 16;
  const int row_lo = min(tile * 16 + g, n - 1);  // rows past n are read (clamped), not stored
  const int row_hi = min(tile * 16 + g + 8, n - 1);
  const uint4* w_lo = weight + static_cast<int64_t>(row_lo) * pieces;
  const uint4* w_hi = weight + static_cast<int64_t>(row_hi) * pieces;
  // The scale rows of this lane's C fragment: c[0..1] belong to weight row g, c[2..3] to g + 8.
  const float* scales_lo = format.row_scales(row_lo);
  const float* scales_hi = format.row_scales(row_hi);
  const uint32_t x_mask = g < m ? ~0u : 0u;  // lanes of x rows past m read row 0 and zero it
  const T* x_row = x + static_cast<int64_t>(g < m ? g : 0) * x_stride;

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const int steps = (k + kStepK - 1) / kStepK;
  // One 64-k step of the warp: this lane's piece p = 4 step + t of both rows (a piece past k
  // multiplies zeros of x: every lane takes part in each mma).
  const auto multiply = [&](const uint4& lo, const uint4& hi, int step) {
    int p = 4 * step + t;
    const uint32_t mask = p < pieces ? x_mask : 0u;
    p = p < pieces ? p : 0;
    const uint4* xv_ptr = reinterpret_cast<const uint4*>(x_row + static_cast<int64_t>(p) * 16);
    uint4 xv[2] = {xv_ptr[0], xv_ptr[1]};
    const uint32_t x_words[8] = {xv[0].x & mask, xv[0].y & mask, xv[0].z & mask, xv[0].w & mask,
                                 xv[1].x & mask, xv[1].y & mask, xv[1].z & mask, xv[1].w & mask};
    const uint32_t lo_words[4] = {lo.x, lo.y, lo.z, lo.w};
    const uint32_t hi_words[4] = {hi.x, hi.y, hi.z, hi.w};
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t a[4] = {F::template pair_to<T>(lo_words[j]), F::template pair_to<T>(hi_words[j]),
                             F::template pair_to<T>(lo_words[j] >> 16),
                             F::template pair_to<T>(hi_words[j] >> 16)};
      mma16816(c, a, x_words[2 * j], x_words[2 * j + 1], T{});
    }
    const float s_lo = format.step_scale(scales_lo, step, k);
    const float s_hi = format.step_scale(scales_hi, step, k);
    acc[0] += c[0] * s_lo;
    acc[1] += c[1] * s_lo;
    acc[2] += c[2] * s_hi;
    acc[3] += c[3] * s_hi;
  };
  const auto load = [&](const uint4* row, int step) {
    const int p = 4 * step + t;
    return p < pieces ? load16_stream(row + p) : make_uint4(0, 0, 0, 0);
  };

  // Chunks of kUnroll steps, every load of a chunk in flight before its first mma (the last chunk
  // predicated, as gemv_4bit_mma).
  for (int base = warp; base < steps; base += kUnroll * kSplit) {
    uint4 lo[kUnroll], hi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      lo[u] = load(w_lo, base + u * kSplit);
      hi[u] = load(w_hi, base + u * kSplit);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) multiply(lo[u], hi[u], base + u * kSplit);
  }

  store_split_k_tile<T, kSplit>(acc, partial, out, tile, m, n);
}

// out [m, n] = x [m, k] @ W^T for m <= 8 rows of 16-bit x (dtype); k % 16 == 0.
template <typename F>
cudaError_t launch(void* out, const void* x, int64_t x_stride, const void* weight, const F& format, int m, int n,
                   int k, DType dtype, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (m > 8 || k % 16 != 0) return cudaErrorInvalidValue;
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;
    } else {
      launch_dependent(gemv_byte_mma_kernel<T, F>, (n + 15) / 16, kSplit * 32, 0, stream, static_cast<T*>(out),
                       static_cast<const T*>(x), x_stride, static_cast<const uint4*>(weight), format, m, n, k);
      return cudaGetLastError();
    }
  });
}

}  // namespace pagedkv::kernels::gemv_byte_mma
