// Torch-free launcher of the mixture-of-experts router's tail: the router logits come from
// pagedkv::linear (the weight-streaming GEMV, spread over many SMs), and this one kernel does what
// HF runs after them in ~6 (fp32 softmax, topk's select and sort, sum, divide, cast). Reads
// nothing on the host (capturable in a CUDA graph).
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

// The most experts the kernel keeps in shared memory (E floats), and the most top_k: one warp
// holds the k chosen experts in registers, one a lane (torch.topk sorts k <= 32 by one bitonic
// network of 32, which the kernel reproduces).
constexpr int64_t kMoeTopkMaxExperts = 4096;
constexpr int64_t kMoeTopkMaxK = 32;

// Per token t, torch's CUDA ops in HF's order: probs = softmax(logits[t]) in fp32 (torch's warp
// softmax: same exp, summation order and division; within 2 ulps of it on the H100 for E <= 1024); the top_k of
// them with torch.topk's set and order (equal probs: the lowest indices at the k-th place, the k
// ordered by its bitonic sort); if normalize, each divided by their fp32 sum in torch.sum's order;
// weights = that, rounded to fp32 (weights_fp32) or the dtype.
// expert_ids [T, k] int64, weights [T, k], logits [T, E]; all contiguous.
cudaError_t moe_topk(int64_t* expert_ids, void* weights, bool weights_fp32, const void* logits,
                     int64_t num_tokens, int64_t top_k, int64_t num_experts, bool normalize, DType dtype,
                     cudaStream_t stream);

}  // namespace pagedkv::kernels
