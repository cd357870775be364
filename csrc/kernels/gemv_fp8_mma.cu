// FP8 (e4m3) weight skinny GEMM on tensor cores for 1..8 rows of x: out^T[n, m] = W[n, k] x^T
// with mma.sync.m16n8k16, W = e4m3 values times an fp32 scale per (block_n x block_k) block.
//
// Why: the CUDA-core skeleton (gemv_dequant.cuh) does one FMA per weight per row of x, so at 8 rows
// the SMs run out of issue slots (27% of the memory bandwidth on the W1 shape). Here the tensor
// cores do the multiply-adds whatever the rows, on the e4m3 values converted exactly to x's
// 16-bit type (one cvt to fp16 pairs; bf16 x takes two more, through fp32). The scale multiplies
// fp32 partial sums, never a weight: each 64-k step of a warp lies in one k-block (block_k % 64 ==
// 0, or one block over all of k), its mma partial is scaled per output row and added, the
// rounding of the CUDA-core kernel (kScalePartial there).
//
// Fragment order (see gemv_mma.cu / gemv_4bit_mma.cu): lane (g = lane / 4, t = lane % 4) loads the
// 16 bytes = 16 k of weight rows g and g + 8 at k0 = 64 step + 16 t. Word j of the piece holds
// k0 + 4j .. 4j + 3: its low half converts to the A register of pair (4j, 4j + 1), its high half to
// (4j + 2, 4j + 3), and the matching B registers are x's words as loaded. One mma per word.
#include <cstdint>
#include <type_traits>

#include <cuda_fp8.h>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv_4bit_mma.h"  // quant_mma_enabled
#include "kernels/gemv_fp8.h"
#include "kernels/gemv_split_k.cuh"
#include "kernels/mma.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kSplit = 8;    // warps per CTA sharing one 16-row tile's k range (as gemv_4bit_mma)
constexpr int kUnroll = 4;   // 64-k steps loaded per warp before the first mma
constexpr int kStepK = 64;   // k per step: 4 lanes (t) x 16 e4m3 values

// Two e4m3 values (low byte first) -> the register of two T values (exact: e4m3 fits both).
template <typename T>
__device__ __forceinline__ uint32_t e4m3x2_to(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
  uint32_t bits;
  if constexpr (std::is_same_v<T, __half>) {
    memcpy(&bits, &h, 4);
  } else {
    const float2 f = __half22float2(__half2(h));
    bits = pack2(f.x, f.y, T{});
  }
  return bits;
}

// out [m, n] = x [m, k] @ W^T. weight: [n, k / 16] 16-byte pieces; scales [ceil(n / block_n),
// ceil(k / block_k)] fp32.
template <typename T>
__global__ void __launch_bounds__(kSplit * 32)
    gemv_fp8_mma_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                        const uint4* __restrict__ weight, const float* __restrict__ scales, int m,
                        int n, int k, int block_n, int block_k) {
  begin_dependent_kernel();
  __shared__ float partial[kSplit - 1][4][32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int tile = blockIdx.x;
  const int pieces = k / 16;
  const int scale_cols = (k + block_k - 1) / block_k;
  const int row_lo = min(tile * 16 + g, n - 1);  // rows past n are read (clamped), not stored
  const int row_hi = min(tile * 16 + g + 8, n - 1);
  const uint4* w_lo = weight + static_cast<int64_t>(row_lo) * pieces;
  const uint4* w_hi = weight + static_cast<int64_t>(row_hi) * pieces;
  // The scale rows of this lane's C fragment: c[0..1] belong to weight row g, c[2..3] to g + 8.
  const float* scales_lo = scales + static_cast<int64_t>(row_lo / block_n) * scale_cols;
  const float* scales_hi = scales + static_cast<int64_t>(row_hi / block_n) * scale_cols;
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
      const uint32_t a[4] = {e4m3x2_to<T>(lo_words[j]), e4m3x2_to<T>(hi_words[j]),
                             e4m3x2_to<T>(lo_words[j] >> 16), e4m3x2_to<T>(hi_words[j] >> 16)};
      mma16816(c, a, x_words[2 * j], x_words[2 * j + 1], T{});
    }
    const int block = min(step * kStepK, k - 1) / block_k;  // the step's k-block (one for all t)
    const float s_lo = __ldg(scales_lo + block);
    const float s_hi = __ldg(scales_hi + block);
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

}  // namespace

bool gemv_fp8_mma_takes(int m, int k, int block_n, int block_k) {
  // 1-2 rows stay on the CUDA-core kernel: measured faster there on the W1 shape (H100: batch 1
  // 3.34 ms a step against 3.80 on tensor cores; batch 8 9.59 against 4.00).
  return m >= 3 && m <= 8 && k % 16 == 0 && block_n > 0 && block_k > 0 &&
         (block_k % kStepK == 0 || block_k >= k) && quant_mma_enabled();
}

cudaError_t gemv_fp8_mma(void* out, const void* x, int64_t x_stride, const uint8_t* weight,
                         const float* scales, int m, int n, int k, int block_n, int block_k,
                         DType dtype, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;
    } else {
      launch_dependent(gemv_fp8_mma_kernel<T>, (n + 15) / 16, kSplit * 32, 0, stream,
                       static_cast<T*>(out), static_cast<const T*>(x), x_stride,
                       reinterpret_cast<const uint4*>(weight), scales, m, n, k, block_n, block_k);
      return cudaGetLastError();
    }
  });
}

}  // namespace pagedkv::kernels
