// CUDA launcher of rope_and_write_kv: check, guard the device, launch on the current stream. The
// kernel lives in csrc/kernels/rope_and_write_kv.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernel_checks.h"
#include "kernels/rope_and_write_kv.h"

namespace pagedkv {

void rope_and_write_kv_cuda(at::Tensor& q, at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                            at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                            const std::optional<at::Tensor>& q_norm_weight,
                            const std::optional<at::Tensor>& k_norm_weight, double epsilon,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  check_rope_and_write_kv_args(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                               q_norm_weight, k_norm_weight, epsilon, k_scale, v_scale);
  check_cuda(q, "q");
  const c10::cuda::CUDAGuard guard(q.device());
  kernels::RopeArgs args{};
  args.q = q.data_ptr();
  args.k = k.data_ptr();
  args.v = v.const_data_ptr();
  args.q_stride = q.stride(0);
  args.k_stride = k.stride(0);
  args.v_stride = v.stride(0);
  args.positions = positions.const_data_ptr<int32_t>();
  args.cos_sin_cache = cos_sin_cache.const_data_ptr<float>();
  args.k_cache = k_cache.data_ptr();
  args.v_cache = v_cache.data_ptr();
  args.slot_mapping = slot_mapping.const_data_ptr<int32_t>();
  args.q_norm_weight = q_norm_weight ? q_norm_weight->const_data_ptr() : nullptr;
  args.k_norm_weight = k_norm_weight ? k_norm_weight->const_data_ptr() : nullptr;
  args.epsilon = static_cast<float>(epsilon);
  const bool fp8 = is_fp8_cache(k_cache);  // check_kv_scales: then both scales are given
  args.k_scale = fp8 ? k_scale->const_data_ptr<float>() : nullptr;
  args.v_scale = fp8 ? v_scale->const_data_ptr<float>() : nullptr;
  args.num_tokens = static_cast<int>(q.size(0));
  args.num_q_heads = static_cast<int>(q.size(1));
  args.num_kv_heads = static_cast<int>(k.size(1));
  args.head_dim = static_cast<int>(q.size(2));
  args.rot_dim = static_cast<int>(cos_sin_cache.size(1));
  args.max_position = static_cast<int>(cos_sin_cache.size(0));
  args.num_slots = k_cache.size(0) * k_cache.size(1);
  C10_CUDA_CHECK(kernels::rope_and_write_kv(args, kernel_dtype(q), c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("rope_and_write_kv", &rope_and_write_kv_cuda); }

}  // namespace pagedkv
