// FP8-weight skinny GEMM for decode steps. What gemv_fp8_mma_takes() goes to the tensor-core kernel
// (gemv_fp8_mma.cu); the rest to this one: the weight-streaming skeleton of gemv_dequant.cuh
// with this format's 16-byte piece: 16 e4m3 values under one block scale (block_k % 16 == 0),
// converted in registers to half pairs (exact: e4m3 is a subset of fp16; one cvt per pair on
// Hopper) then fp32. The block's fp32 scale multiplies each row's 16-term fp32 partial sum once.
#include <cstdint>

#include <cuda_fp8.h>

#include "kernels/fp8_convert.cuh"
#include "kernels/gemv_dequant.cuh"
#include "kernels/gemv_fp8.h"

namespace pagedkv::kernels {
namespace {

struct Fp8 {
  static constexpr int kPieceCols = 16;  // e4m3 values in 16 bytes
  static constexpr bool kScalePartial = true;
  static constexpr int kTableSize = 0;
  const float* scales;  // [ceil(n / block_n), ceil(k / block_k)]
  int block_n;
  int block_k;

  struct Row {
    const float* scales;  // this row's block row
    int pieces_per_block;

    __device__ __forceinline__ float dequantize(const uint4& piece, int p, float (&w)[kPieceCols]) const {
      const float scale = __ldg(scales + p / pieces_per_block);
      const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 lo = e4m3x2_to_float2(words[j]);
        const float2 hi = e4m3x2_to_float2(words[j] >> 16);
        w[4 * j] = lo.x;
        w[4 * j + 1] = lo.y;
        w[4 * j + 2] = hi.x;
        w[4 * j + 3] = hi.y;
      }
      return scale;
    }
  };

  __device__ __forceinline__ Row row(int row, int k, const float*) const {
    const int scale_cols = (k + block_k - 1) / block_k;
    return {scales + static_cast<int64_t>(row / block_n) * scale_cols, block_k / kPieceCols};
  }
};

}  // namespace

cudaError_t gemv_fp8(void* out, const void* x, int64_t x_stride, const uint8_t* weight, const float* scales,
                     int m, int n, int k, int block_n, int block_k, DType dtype, cudaStream_t stream) {
  if (n > 0 && gemv_fp8_mma_takes(m, k, block_n, block_k)) {
    return gemv_fp8_mma(out, x, x_stride, weight, scales, m, n, k, block_n, block_k, dtype, stream);
  }
  const bool sizes_ok = k % Fp8::kPieceCols == 0 && block_k % Fp8::kPieceCols == 0 && block_n > 0;
  return gemv_dequant::launch(out, x, x_stride, weight, Fp8{scales, block_n, block_k}, m, n, k, sizes_ok, dtype,
                              stream);
}

}  // namespace pagedkv::kernels
