// Int4 weight-only skinny GEMM (m <= kGemvW4A16MaxRows rows of activations) for decode steps, on
// the model of gemv.cu: one warp per output column (one row of W), each lane streams 16 bytes of
// its packed row per iteration (32 int4 values of one group), dequantizes them in registers to
// fp32 ((q - zero) * scale is exact in fp32: a 5-bit integer times a 16-bit scale) and multiplies
// them with the matching 32 elements of every x row. fp32 accumulation, one warp-shuffle
// reduction per output, rounded once to x's dtype.
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv_w4a16.h"

namespace pagedkv::kernels {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kUnroll = 2;      // 16-byte pieces of the row loaded before the first is used
constexpr int kPieceCols = 32;  // int4 values in 16 bytes

// kM: a compile-time bound on the rows (accumulators in registers); rows m..kM-1 are skipped.
template <typename T, typename S, int kM>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gemv_w4a16_kernel(T* __restrict__ out,             // [m, n]
                      const T* __restrict__ x,         // [m, k], row stride x_stride
                      int64_t x_stride,
                      const uint4* __restrict__ packed,  // [n, k / 32] 16-byte pieces
                      const S* __restrict__ scales,      // [n, k / group_size]
                      const uint8_t* __restrict__ zeros,  // [n, k / group_size]
                      int m, int n, int k, int group_size) {
  begin_dependent_kernel();
  using V = Vec<T, 8>;  // 16 bytes of x
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;  // the output column
  if (row >= n) return;
  const int pieces = k / kPieceCols;
  const int pieces_per_group = group_size / kPieceCols;
  const int groups = k / group_size;
  const uint4* w_row = packed + static_cast<int64_t>(row) * pieces;
  const S* s_row = scales + static_cast<int64_t>(row) * groups;
  const uint8_t* z_row = zeros + static_cast<int64_t>(row) * groups;

  float acc[kM];
#pragma unroll
  for (int i = 0; i < kM; ++i) acc[i] = 0.f;

  auto multiply = [&](const uint4& piece, int p) {
    const int g = p / pieces_per_group;
    const float scale = to_float(s_row[g]);
    const float zero = static_cast<float>(z_row[g]);
    const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
    float w[kPieceCols];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) w[8 * j + e] = (static_cast<float>((words[j] >> (4 * e)) & 0xFu) - zero) * scale;
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      if (i >= m) break;
      const V* xv = reinterpret_cast<const V*>(x + i * x_stride + static_cast<int64_t>(p) * kPieceCols);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const V v = xv[j];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i] += w[8 * j + e] * to_float(v.v[e]);
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

template <typename T, typename S, int kM>
cudaError_t launch_m(void* out, const void* x, int64_t x_stride, const int32_t* packed, const void* scales,
                     const uint8_t* zeros, int m, int n, int k, int group_size, cudaStream_t stream) {
  const int blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  launch_dependent(gemv_w4a16_kernel<T, S, kM>, blocks, kWarpsPerBlock * 32, 0, stream, static_cast<T*>(out),
                   static_cast<const T*>(x), x_stride, reinterpret_cast<const uint4*>(packed),
                   static_cast<const S*>(scales), zeros, m, n, k, group_size);
  return cudaGetLastError();
}

template <typename T, typename S>
cudaError_t launch_rows(void* out, const void* x, int64_t x_stride, const int32_t* packed, const void* scales,
                        const uint8_t* zeros, int m, int n, int k, int group_size, cudaStream_t stream) {
  if (m <= 1) return launch_m<T, S, 1>(out, x, x_stride, packed, scales, zeros, m, n, k, group_size, stream);
  if (m <= 2) return launch_m<T, S, 2>(out, x, x_stride, packed, scales, zeros, m, n, k, group_size, stream);
  if (m <= 4) return launch_m<T, S, 4>(out, x, x_stride, packed, scales, zeros, m, n, k, group_size, stream);
  return launch_m<T, S, 8>(out, x, x_stride, packed, scales, zeros, m, n, k, group_size, stream);
}

}  // namespace

cudaError_t gemv_w4a16(void* out, const void* x, int64_t x_stride, const int32_t* packed,
                       const void* scales, const uint8_t* zeros, int m, int n, int k, int group_size,
                       DType dtype, DType scale_dtype, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (m > kGemvW4A16MaxRows || group_size % kPieceCols != 0 || k % group_size != 0) {
    return cudaErrorInvalidValue;
  }
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;  // fp32 x goes to cuBLAS (the launcher decides)
    } else {
      return dispatch_dtype(scale_dtype, [&](auto scale_tag) -> cudaError_t {
        using S = decltype(scale_tag);
        if constexpr (sizeof(S) != 2) {
          return cudaErrorInvalidValue;  // scales are 16-bit (checked by the launcher)
        } else {
          return launch_rows<T, S>(out, x, x_stride, packed, scales, zeros, m, n, k, group_size, stream);
        }
      });
    }
  });
}

}  // namespace pagedkv::kernels
