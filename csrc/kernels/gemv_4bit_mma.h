// Torch-free launchers of the 4-bit-weight skinny matrix products on tensor cores (1..8 rows of x;
// kernels/gemv_4bit_mma.cu says why they beat the CUDA-core kernels of gemv_w4a16.h / gemv_nf4.h
// there).
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

// num_sms: the device's SM count (the launch plan compares the tile count with it).
// Same operands and layout as gemv_w4a16 (gemv_w4a16.h), with scales (and float zeros) in x's
// dtype (dtype) and m <= 8. Each weight is dequantized to that dtype ((q - z) * s rounded once, as
// PyTorch's dequantization in that dtype; float zeros: (q - 8) * s + z by one fused multiply-add,
// as tinygemm's), products summed in fp32; except for groups of 128 << j k and more than 4 or at
// most 2 16-row tiles an SM, where q - z (float zeros: q - 8, and the zeros times the group's
// sum of x) goes unrounded into the products and each group's fp32 sums are scaled (nearer the
// exact product).
cudaError_t gemv_w4a16_mma(void* out, const void* x, int64_t x_stride, const int32_t* packed,
                           const void* scales, const void* zeros, bool float_zeros, int m, int n, int k,
                           int group_size, int num_sms, DType dtype, cudaStream_t stream);

// Same operands and layout as gemv_nf4 (gemv_nf4.h), m <= 8. Each weight is code[q] * absmax in
// fp32 rounded once to x's dtype (bitsandbytes' dequantize_4bit), products summed in fp32.
cudaError_t gemv_nf4_mma(void* out, const void* x, int64_t x_stride, const uint8_t* packed,
                         const float* absmax, const float* code, int m, int n, int k,
                         int block_size, int num_sms, DType dtype, cudaStream_t stream);

// gemv_nf4_mma for absmax blocks of 64 << j columns (gemv_nf4_mma.cu): the codes rounded to x's
// dtype, each block's fp32 sums times its absmax.
cudaError_t gemv_nf4_block_scaled_mma(void* out, const void* x, int64_t x_stride, const uint8_t* packed,
                                      const float* absmax, const float* code, int m, int n, int k,
                                      int block_size, int num_sms, DType dtype, cudaStream_t stream);

// PAGEDKV_QUANT_MMA=0 sends every row count of int4, NF4, FP8 and int8 weights to the CUDA-core
// kernels (an A/B switch, read once per process).
bool quant_mma_enabled();

}  // namespace pagedkv::kernels
