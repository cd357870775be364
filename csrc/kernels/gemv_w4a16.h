// Torch-free launcher of the int4-weight skinny matrix product of decode steps: out = x @ W^T
// with W dequantized in registers from 4-bit values and per-group scales and zero points.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/gemv_dequant.h"

namespace pagedkv::kernels {

// out: [m, n] contiguous (x's dtype); x: [m, k] 16-bit, row stride x_stride elements;
// m <= kGemvDequantMaxRows;
// packed: [n, k / 8] int32, value of column 8w + e in bits 4e..4e+3 of word w;
// scales: [n, k / group_size] (scale_dtype, 16-bit); zeros: [n, k / group_size] uint8,
// W[j, c] = (q[j, c] - zeros[j, c / group_size]) * scales[j, c / group_size]; or, float_zeros,
// scale_dtype (torchao's tinygemm form), W[j, c] = (q[j, c] - 8) * scales[..] + zeros[..].
// group_size % 32 == 0, k % group_size == 0, x_stride % 8 == 0, x and packed 16-byte aligned
// (the launcher checks).
cudaError_t gemv_w4a16(void* out, const void* x, int64_t x_stride, const int32_t* packed,
                       const void* scales, const void* zeros, bool float_zeros, int m, int n, int k,
                       int group_size, int num_sms, DType dtype, DType scale_dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
