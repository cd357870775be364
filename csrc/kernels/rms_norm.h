// Torch-free launchers of the RMSNorm kernels. Pointers are device pointers of `dtype`
// elements, rows are contiguous; the call is enqueued on `stream` and returns the launch status.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

// out, input: [rows, hidden]; weight: [hidden]. gemma_style: scale by (1 + weight) in fp32 and
// round once (HF's GemmaRMSNorm), else round the normalized value, then times weight (Llama's).
cudaError_t rms_norm(void* out, const void* input, const void* weight, int64_t rows, int hidden,
                     float epsilon, bool gemma_style, DType dtype, cudaStream_t stream);

// input, residual: [rows, hidden], both updated in place; weight: [hidden].
cudaError_t fused_add_rms_norm(void* input, void* residual, const void* weight, int64_t rows,
                               int hidden, float epsilon, bool gemma_style, DType dtype,
                               cudaStream_t stream);

}  // namespace pagedkv::kernels
