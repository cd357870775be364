// Torch-free launcher of the skinny matrix product used by decode steps: out = x @ weight^T
// (+ bias) for a few rows of x, reading the weight once at close to memory bandwidth.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

// Largest number of rows of x the CUDA-core kernel (gemv, gemv_silu_mul) handles. Measured on an
// H100 (lab/measurements.md): 1-2 rows beat cuBLAS by 4-9%, 4 rows tie, 8 rows lose 19%.
constexpr int kGemvMaxRows = 2;
// Largest number of rows of the tensor-core kernel (gemv_mma: one m16n8k16 n-tile); the launcher
// sends kGemvMaxRows + 1 .. kGemvMmaMaxRows rows there and more rows to cuBLAS. Measured on an
// H100: level with cuBLAS at 4 and 8 rows (0.93-1.02 per matrix).
constexpr int kGemvMmaMaxRows = 8;

// out: [m, n]; x: [m, k] (row stride x_stride elements); weight: [n, k] contiguous;
// bias: [n] or nullptr. k % 8 == 0 and all pointers 16-byte aligned (the launcher checks).
cudaError_t gemv(void* out, const void* x, int64_t x_stride, const void* weight, const void* bias,
                 int m, int n, int k, DType dtype, cudaStream_t stream);

// out: [m, n] = silu(x @ gate^T) * (x @ up^T) where gate_up: [2n, k] holds the gate rows then
// the up rows (HF's MLP with fused gate/up weights, HF's rounding). Same conditions as gemv.
cudaError_t gemv_silu_mul(void* out, const void* x, int64_t x_stride, const void* gate_up, int m,
                          int n, int k, DType dtype, cudaStream_t stream);

// gemv (silu_mul = false, bias or nullptr) or gemv_silu_mul (silu_mul = true, weight = gate_up
// [2n, k], bias nullptr) on tensor cores for m <= kGemvMmaMaxRows (csrc/kernels/gemv_mma.cu).
// Same conditions as gemv.
cudaError_t gemv_mma(void* out, const void* x, int64_t x_stride, const void* weight,
                     const void* bias, int m, int n, int k, bool silu_mul, DType dtype,
                     cudaStream_t stream);

}  // namespace pagedkv::kernels
