// Torch-free launcher of the SiLU-and-multiply kernel (the gated MLP's activation).
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

// out [rows, intermediate], x [rows, 2 * intermediate] (gate, then up), both contiguous.
// gelu_tanh: act = GELU (tanh approximation) instead of SiLU.
cudaError_t silu_and_mul(void* out, const void* x, int64_t rows, int64_t intermediate, bool gelu_tanh,
                         DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
