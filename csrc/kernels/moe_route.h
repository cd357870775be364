// Torch-free launcher of the fused mixture-of-experts router: one kernel does what HF's router does
// in ~7 (GEMV, fp32 softmax, topk's select and sort, sum, divide, cast), so a decode step pays one
// launch a layer. Reads nothing on the host (capturable in a CUDA graph).
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

// The most experts (and so top_k) the kernel keeps in shared memory: (E + k) floats.
constexpr int64_t kMoeRouteMaxExperts = 4096;

// Per token t (HF's order): logits = round(x[t] . router^T) to the dtype; probs = softmax in fp32;
// the top_k largest probs, descending, equal probs lower expert index first; if normalize, each
// divided by their fp32 sum; weights = that, rounded to fp32 (weights_fp32) or the dtype.
// expert_ids [T, k] int64, weights [T, k], x [T, D], router [E, D]; all contiguous.
cudaError_t moe_route(int64_t* expert_ids, void* weights, bool weights_fp32, const void* x,
                      const void* router, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                      int64_t hidden, bool normalize, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
