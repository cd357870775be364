// Torch-free launcher of the fused (RMSNorm +) RoPE + KV-cache write kernel. Pointers are device
// pointers; element strides count elements of `dtype`.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

struct RopeArgs {
  void* q;                      // [num_tokens, num_q_heads, head_dim], token stride q_stride
  void* k;                      // [num_tokens, num_kv_heads, head_dim], token stride k_stride
  const void* v;                // [num_tokens, num_kv_heads, head_dim], token stride v_stride
  int64_t q_stride, k_stride, v_stride;
  const int32_t* positions;     // [num_tokens], in [0, max_position)
  const float* cos_sin_cache;   // [max_position, rot_dim]: cos of the rot_dim/2 freqs, then sin
  void* k_cache;                // [num_slots, num_kv_heads, head_dim] (blocks flattened)
  void* v_cache;                // [num_slots, num_kv_heads, head_dim]
  const int32_t* slot_mapping;  // [num_tokens], -1 = do not write
  const void* q_norm_weight;    // [head_dim] or nullptr (no per-head RMSNorm of q)
  const void* k_norm_weight;    // [head_dim] or nullptr
  float epsilon;
  // An fp8 (e4m3) cache: each K/V element stored as round(clamp(x / scale, -448, 448)), the
  // scales read from these one-element device buffers. Both nullptr: a cache of q's dtype.
  const float* k_scale;
  const float* v_scale;
  int num_tokens, num_q_heads, num_kv_heads, head_dim, rot_dim, max_position;
  int64_t num_slots;
};

cudaError_t rope_and_write_kv(const RopeArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
