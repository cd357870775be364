// Torch-free launcher of the NF4-weight skinny matrix product of decode steps: out = x @ W^T with
// W looked up in registers from 4-bit codes in a 16-entry codebook, times per-block absmax.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/gemv_dequant.h"

namespace pagedkv::kernels {

// out: [m, n] contiguous (x's dtype); x: [m, k] 16-bit, row stride x_stride elements;
// m <= kGemvDequantMaxRows;
// packed: [n, k / 2] uint8, column 2b in the high nibble of byte b, 2b + 1 in the low one;
// absmax: [n, k / block_size] float32; code: [16] float32;
// W[j, c] = code[q[j, c]] * absmax[j, c / block_size].
// block_size % 32 == 0, k % block_size == 0, x_stride % 8 == 0, x and packed 16-byte aligned
// (the launcher checks).
cudaError_t gemv_nf4(void* out, const void* x, int64_t x_stride, const uint8_t* packed, const float* absmax,
                     const float* code, int m, int n, int k, int block_size, int num_sms, DType dtype,
                     cudaStream_t stream);

}  // namespace pagedkv::kernels
