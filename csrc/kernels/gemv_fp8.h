// Torch-free launcher of the FP8-weight skinny matrix product of decode steps: out = x @ W^T with
// W converted in registers from float8 e4m3 values and multiplied by their block's fp32 scale.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/gemv_dequant.h"

namespace pagedkv::kernels {

// out: [m, n] contiguous (x's dtype); x: [m, k] 16-bit, row stride x_stride elements;
// m <= kGemvDequantMaxRows;
// weight: [n, k] float8_e4m3fn bytes; scales: [ceil(n / block_n), ceil(k / block_k)] float32;
// W[j, c] = weight[j, c] * scales[j / block_n, c / block_k].
// k % 16 == 0, block_k % 16 == 0, x_stride % 8 == 0, x and weight 16-byte aligned (the launcher
// checks).
cudaError_t gemv_fp8(void* out, const void* x, int64_t x_stride, const uint8_t* weight, const float* scales,
                     int m, int n, int k, int block_n, int block_k, DType dtype, cudaStream_t stream);

// The same product on tensor cores (kernels/gemv_fp8_mma.cu), for what gemv_fp8_mma_takes():
// 3..8 rows, each 64-k step inside one k-block (block_k % 64 == 0, or block_k >= k), and
// PAGEDKV_QUANT_MMA not 0. gemv_fp8 sends those there itself.
bool gemv_fp8_mma_takes(int m, int k, int block_n, int block_k);
cudaError_t gemv_fp8_mma(void* out, const void* x, int64_t x_stride, const uint8_t* weight,
                         const float* scales, int m, int n, int k, int block_n, int block_k,
                         DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
