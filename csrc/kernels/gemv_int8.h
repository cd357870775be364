// Torch-free launcher of the int8-weight (bitsandbytes LLM.int8) skinny matrix product of decode
// steps: out = x @ W^T with W converted in registers from int8, each output row's scale applied
// to its sums.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/gemv_dequant.h"

namespace pagedkv::kernels {

// out: [m, n] contiguous (x's dtype); x: [m, k] 16-bit, row stride x_stride elements;
// m <= kGemvDequantMaxRows; q: [n, k] int8; scb: [n] float32; W[j, c] = q[j, c] * scb[j] / 127.
// k % 16 == 0, x_stride % 8 == 0, x and q 16-byte aligned (the launcher checks).
cudaError_t gemv_int8(void* out, const void* x, int64_t x_stride, const int8_t* q, const float* scb, int m, int n,
                      int k, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
