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

}  // namespace pagedkv::kernels
