// Torch-free launchers of the mixture-of-experts decode kernels: each (token, chosen expert) pair
// reads only its expert's rows, so a decode step reads the top-k experts, not all of them. Expert
// ids are read on the device (no host sync: the step stays capturable in a CUDA graph).
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

// out [T, k, I] = silu(x[t] . gate_up[e, :I]^T) * (x[t] . gate_up[e, I:]^T), e = expert_ids[t, j],
// each product rounded to the dtype (HF's rounding). x [T, D], gate_up [E, 2I, D], expert_ids
// [T, k] int64; all contiguous. An id outside [0, E) gives zeros.
cudaError_t moe_gate_up_silu(void* out, const void* x, const void* gate_up, const int64_t* expert_ids,
                             int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                             int64_t intermediate, DType dtype, cudaStream_t stream);

// out [T, D] = sum_j round_w(round(down[e_j] . act[t, j]) * weights[t, j]) in fp32, rounded to the
// dtype; round_w rounds to the weights' dtype (fp32 when weights_fp32, else the model's). act
// [T, k, I], down [E, D, I], expert_ids, weights [T, k]; all contiguous.
cudaError_t moe_down_sum(void* out, const void* act, const void* down, const int64_t* expert_ids,
                         const void* weights, bool weights_fp32, int64_t num_tokens, int64_t top_k,
                         int64_t num_experts, int64_t hidden, int64_t intermediate, DType dtype,
                         cudaStream_t stream);

// The FP8 experts' kernels (FineGrainedFP8, compressed-tensors: moe_expert_rows.cuh's Fp8Rows):
// the dense kernels' results on the weights W[e, r, c] = T(float(q[e, r, c]) * scales[e, r /
// block_n, c / block_k]) (q e4m3, scales fp32 [E, ceil(R / block_n), ceil(C / block_k)]), bit
// for bit, reading the stored bytes once. The input width of each projection (hidden for gate/up,
// intermediate for down) and block_k are multiples of kMoeQuantAlign; x / act and the e4m3 weights
// 16-byte aligned (cudaErrorInvalidValue otherwise). gate, up [E, I, D]; down [E, D, I].
constexpr int kMoeQuantAlign = 16;

cudaError_t moe_gate_up_silu_fp8(void* out, const void* x, const uint8_t* gate, const float* gate_scales,
                                 const uint8_t* up, const float* up_scales, const int64_t* expert_ids,
                                 int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                                 int64_t intermediate, int block_n, int block_k, DType dtype, cudaStream_t stream);

cudaError_t moe_down_sum_fp8(void* out, const void* act, const uint8_t* down, const float* down_scales,
                             const int64_t* expert_ids, const void* weights, bool weights_fp32, int64_t num_tokens,
                             int64_t top_k, int64_t num_experts, int64_t hidden, int64_t intermediate, int block_n,
                             int block_k, DType dtype, cudaStream_t stream);

// One int4 projection of every expert (moe_expert_rows.cuh's Int4Rows): W[e, r, c] = T(float(q -
// zeros[e, r, c / g]) * float(scales[e, r, c / g])), q the low (even c) or high nibble of
// packed[e, r, c / 2]. packed [E, R, C / 2] uint8, scales [E, R, C / g] of scale_dtype, zeros
// [E, R, C / g] uint8, contiguous.
struct Int4ExpertsArgs {
  const uint8_t* packed;
  const void* scales;
  const uint8_t* zeros;
  int group_size;  // g
  DType scale_dtype;
};

// The int4 experts' kernels: the dense kernels' results on the weights dequantized as above to the
// dtype, bit for bit. Each projection's input width and g multiples of kMoeQuantAlign, the width
// a multiple of g; x / act and packed 16-byte aligned (cudaErrorInvalidValue otherwise).
cudaError_t moe_gate_up_silu_int4(void* out, const void* x, const Int4ExpertsArgs& gate, const Int4ExpertsArgs& up,
                                  const int64_t* expert_ids, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                  int64_t hidden, int64_t intermediate, DType dtype, cudaStream_t stream);

cudaError_t moe_down_sum_int4(void* out, const void* act, const Int4ExpertsArgs& down, const int64_t* expert_ids,
                              const void* weights, bool weights_fp32, int64_t num_tokens, int64_t top_k,
                              int64_t num_experts, int64_t hidden, int64_t intermediate, DType dtype,
                              cudaStream_t stream);

}  // namespace pagedkv::kernels
