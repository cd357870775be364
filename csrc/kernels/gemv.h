// Torch-free launcher of the skinny matrix product used by decode steps: out = x @ weight^T
// (+ bias) for a few rows of x, reading the weight once at close to memory bandwidth.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

// Largest number of rows of x one launch handles (beyond it the product is a GEMM: cuBLAS).
constexpr int kGemvMaxRows = 8;

// out: [m, n]; x: [m, k] (row stride x_stride elements); weight: [n, k] contiguous;
// bias: [n] or nullptr. k % 8 == 0 and all pointers 16-byte aligned (the launcher checks).
cudaError_t gemv(void* out, const void* x, int64_t x_stride, const void* weight, const void* bias,
                 int m, int n, int k, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
