// The skeleton of the quantized weight-streaming GEMVs of decode steps (m <= kGemvDequantMaxRows
// rows of 16-bit x), on the model of gemv.cu: one warp per output column (one row of W), each lane
// streams 16 bytes of its row per iteration (kUnroll pieces loaded before the first is used),
// has the format dequantize them in registers to fp32 and multiplies them with the matching
// elements of every x row. fp32 accumulation, one warp-shuffle reduction per output, rounded once
// to x's dtype. Only the format policy F differs between int4, fp8 and nf4:
//   static constexpr int kPieceCols;      weight columns in one 16-byte piece (a multiple of 8)
//   static constexpr bool kScalePartial;  true: the piece's scale multiplies each x row's partial
//                                         sum over the piece; false: dequantize folded it into w
//   static constexpr int kTableSize;      fp32 values of `table` copied to shared memory per CTA
//   const float* table;                   (nf4's codebook; needed only when kTableSize > 0)
//   Row row(int row, int k, const float* shared_table) const;  the row's scale pointers
//   Row::dequantize(uint4 piece, int p, float (&w)[kPieceCols]) -> piece p's scale
#pragma once
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv_dequant.h"

namespace pagedkv::kernels::gemv_dequant {

constexpr int kWarpsPerBlock = 4;
constexpr int kUnroll = 2;  // 16-byte pieces of the row loaded before the first is used

// sum += w . x over one piece's kCols columns (kCols / 8 16-byte vectors of x).
template <int kCols, typename V>
__device__ __forceinline__ void dot_piece(const float (&w)[kCols], const V* xv, float& sum) {
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
    const V v = xv[j];
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += w[8 * j + e] * to_float(v.v[e]);
  }
}

// kM: a compile-time bound on the rows (accumulators in registers); rows m..kM-1 are skipped.
template <typename T, typename F, int kM>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gemv_dequant_kernel(T* __restrict__ out,             // [m, n]
                        const T* __restrict__ x,         // [m, k], row stride x_stride
                        int64_t x_stride,
                        const uint4* __restrict__ weight,  // [n, k / F::kPieceCols] 16-byte pieces
                        const F format,                    // the format's scales (and table)
                        int m, int n, int k) {
  begin_dependent_kernel();
  __shared__ float table[F::kTableSize > 0 ? F::kTableSize : 1];
  if constexpr (F::kTableSize > 0) {
    if (threadIdx.x < F::kTableSize) table[threadIdx.x] = format.table[threadIdx.x];
    __syncthreads();  // before any warp leaves: every thread of the CTA reaches it
  }
  using V = Vec<T, 8>;  // 16 bytes of x
  constexpr int kPieceCols = F::kPieceCols;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;  // the output column
  if (row >= n) return;
  const int pieces = k / kPieceCols;
  const uint4* w_row = weight + static_cast<int64_t>(row) * pieces;
  const typename F::Row format_row = format.row(row, k, table);

  float acc[kM];
#pragma unroll
  for (int i = 0; i < kM; ++i) acc[i] = 0.f;

  auto multiply = [&](const uint4& piece, int p) {
    float w[kPieceCols];
    const float scale = format_row.dequantize(piece, p, w);
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      if (i >= m) break;
      const V* xv = reinterpret_cast<const V*>(x + i * x_stride + static_cast<int64_t>(p) * kPieceCols);
      if constexpr (F::kScalePartial) {
        float partial = 0.f;
        dot_piece<kPieceCols>(w, xv, partial);
        acc[i] += partial * scale;
      } else {
        dot_piece<kPieceCols>(w, xv, acc[i]);
      }
    }
  };

  int p = lane;
  for (; p + (kUnroll - 1) * 32 < pieces; p += kUnroll * 32) {
    uint4 piece[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) piece[u] = load16_stream(w_row + p + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) multiply(piece[u], p + u * 32);
  }
  for (; p < pieces; p += 32) multiply(load16_stream(w_row + p), p);

#pragma unroll
  for (int i = 0; i < kM; ++i) {
    if (i >= m) break;
    const float sum = warp_sum(acc[i]);
    if (lane == 0) out[static_cast<int64_t>(i) * n + row] = from_float<T>(sum);
  }
}

template <typename T, typename F, int kM>
cudaError_t launch_m(void* out, const void* x, int64_t x_stride, const void* weight, const F& format, int m, int n,
                     int k, cudaStream_t stream) {
  const int blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  launch_dependent(gemv_dequant_kernel<T, F, kM>, blocks, kWarpsPerBlock * 32, 0, stream, static_cast<T*>(out),
                   static_cast<const T*>(x), x_stride, static_cast<const uint4*>(weight), format, m, n, k);
  return cudaGetLastError();
}

// out [m, n] = x [m, k] @ W^T for 1..kGemvDequantMaxRows rows of 16-bit x (dtype), W streamed
// from `weight` and dequantized by `format`; sizes_ok: the format's own size conditions hold.
template <typename F>
cudaError_t launch(void* out, const void* x, int64_t x_stride, const void* weight, const F& format, int m, int n,
                   int k, bool sizes_ok, DType dtype, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (m > kGemvDequantMaxRows || !sizes_ok) return cudaErrorInvalidValue;
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;  // fp32 x goes to cuBLAS (the launcher decides)
    } else {
      if (m <= 1) return launch_m<T, F, 1>(out, x, x_stride, weight, format, m, n, k, stream);
      if (m <= 2) return launch_m<T, F, 2>(out, x, x_stride, weight, format, m, n, k, stream);
      if (m <= 4) return launch_m<T, F, 4>(out, x, x_stride, weight, format, m, n, k, stream);
      return launch_m<T, F, 8>(out, x, x_stride, weight, format, m, n, k, stream);
    }
  });
}

}  // namespace pagedkv::kernels::gemv_dequant
