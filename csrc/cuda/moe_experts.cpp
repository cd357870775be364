// CUDA launchers of moe_gate_up_silu and moe_down_sum, dense, FP8 and int4: check, guard the device,
// launch on the current stream. The kernels live in csrc/kernels/moe_experts.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "moe_checks.h"
#include "moe_quantized_checks.h"
#include "kernels/alignment.h"
#include "kernels/moe_experts.h"

namespace pagedkv {

void moe_gate_up_silu_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                           const at::Tensor& expert_ids) {
  check_moe_gate_up_silu_args(out, x, gate_up, expert_ids);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(kernels::moe_gate_up_silu(out.data_ptr(), x.const_data_ptr(), gate_up.const_data_ptr(),
                                           expert_ids.const_data_ptr<int64_t>(), x.size(0), expert_ids.size(1),
                                           gate_up.size(0), x.size(1), out.size(2), kernel_dtype(x),
                                           c10::cuda::getCurrentCUDAStream()));
}

void moe_down_sum_cuda(at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                       const at::Tensor& expert_ids, const at::Tensor& weights) {
  check_moe_down_sum_args(out, act, down, expert_ids, weights);
  check_cuda(act, "act");
  const c10::cuda::CUDAGuard guard(act.device());
  C10_CUDA_CHECK(kernels::moe_down_sum(out.data_ptr(), act.const_data_ptr(), down.const_data_ptr(),
                                       expert_ids.const_data_ptr<int64_t>(), weights.const_data_ptr(),
                                       weights.scalar_type() == at::kFloat, act.size(0), act.size(1),
                                       down.size(0), down.size(1), act.size(2), kernel_dtype(act),
                                       c10::cuda::getCurrentCUDAStream()));
}

namespace {

// The quantized experts' kernels read 16-byte vectors of the activations and whole vectors of
// stored values from each row (rows of kMoeQuantAlign values: row starts keep the base's alignment).
void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(aligned16(t.const_data_ptr()), "pagedkv: ", name, " starts at an address that is not a "
              "multiple of 16 bytes; the quantized expert kernels need 16-byte aligned tensors (e.g. a .clone())");
}

kernels::Int4ExpertsArgs int4_args(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                                   int64_t group_size) {
  return {static_cast<const uint8_t*>(packed.const_data_ptr()), scales.const_data_ptr(),
          static_cast<const uint8_t*>(zeros.const_data_ptr()), static_cast<int>(group_size), kernel_dtype(scales)};
}

}  // namespace

void moe_gate_up_silu_fp8_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate,
                               const at::Tensor& gate_scales, const at::Tensor& up, const at::Tensor& up_scales,
                               const at::Tensor& expert_ids, int64_t block_n, int64_t block_k) {
  check_moe_gate_up_silu_fp8_args(out, x, gate, gate_scales, up, up_scales, expert_ids, block_n, block_k);
  check_cuda(x, "x");
  check_aligned(x, "x");
  check_aligned(gate, "gate");
  check_aligned(up, "up");
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(kernels::moe_gate_up_silu_fp8(
      out.data_ptr(), x.const_data_ptr(), static_cast<const uint8_t*>(gate.const_data_ptr()),
      gate_scales.const_data_ptr<float>(), static_cast<const uint8_t*>(up.const_data_ptr()),
      up_scales.const_data_ptr<float>(), expert_ids.const_data_ptr<int64_t>(), x.size(0), expert_ids.size(1),
      gate.size(0), x.size(1), gate.size(1), static_cast<int>(block_n), static_cast<int>(block_k), kernel_dtype(x),
      c10::cuda::getCurrentCUDAStream()));
}

void moe_down_sum_fp8_cuda(at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                           const at::Tensor& down_scales, const at::Tensor& expert_ids, const at::Tensor& weights,
                           int64_t block_n, int64_t block_k) {
  check_moe_down_sum_fp8_args(out, act, down, down_scales, expert_ids, weights, block_n, block_k);
  check_cuda(act, "act");
  check_aligned(act, "act");
  check_aligned(down, "down");
  const c10::cuda::CUDAGuard guard(act.device());
  C10_CUDA_CHECK(kernels::moe_down_sum_fp8(
      out.data_ptr(), act.const_data_ptr(), static_cast<const uint8_t*>(down.const_data_ptr()),
      down_scales.const_data_ptr<float>(), expert_ids.const_data_ptr<int64_t>(), weights.const_data_ptr(),
      weights.scalar_type() == at::kFloat, act.size(0), act.size(1), down.size(0), down.size(1), act.size(2),
      static_cast<int>(block_n), static_cast<int>(block_k), kernel_dtype(act), c10::cuda::getCurrentCUDAStream()));
}

void moe_gate_up_silu_int4_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate,
                                const at::Tensor& gate_scales, const at::Tensor& gate_zeros, const at::Tensor& up,
                                const at::Tensor& up_scales, const at::Tensor& up_zeros, const at::Tensor& expert_ids,
                                int64_t group_size) {
  check_moe_gate_up_silu_int4_args(out, x, gate, gate_scales, gate_zeros, up, up_scales, up_zeros, expert_ids,
                                   group_size);
  check_cuda(x, "x");
  check_aligned(x, "x");
  check_aligned(gate, "gate");
  check_aligned(up, "up");
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(kernels::moe_gate_up_silu_int4(
      out.data_ptr(), x.const_data_ptr(), int4_args(gate, gate_scales, gate_zeros, group_size),
      int4_args(up, up_scales, up_zeros, group_size), expert_ids.const_data_ptr<int64_t>(), x.size(0),
      expert_ids.size(1), gate.size(0), x.size(1), gate.size(1), kernel_dtype(x), c10::cuda::getCurrentCUDAStream()));
}

void moe_down_sum_int4_cuda(at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                            const at::Tensor& down_scales, const at::Tensor& down_zeros, const at::Tensor& expert_ids,
                            const at::Tensor& weights, int64_t group_size) {
  check_moe_down_sum_int4_args(out, act, down, down_scales, down_zeros, expert_ids, weights, group_size);
  check_cuda(act, "act");
  check_aligned(act, "act");
  check_aligned(down, "down");
  const c10::cuda::CUDAGuard guard(act.device());
  C10_CUDA_CHECK(kernels::moe_down_sum_int4(
      out.data_ptr(), act.const_data_ptr(), int4_args(down, down_scales, down_zeros, group_size),
      expert_ids.const_data_ptr<int64_t>(), weights.const_data_ptr(), weights.scalar_type() == at::kFloat,
      act.size(0), act.size(1), down.size(0), down.size(1), act.size(2), kernel_dtype(act),
      c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("moe_gate_up_silu", &moe_gate_up_silu_cuda);
  m.impl("moe_down_sum", &moe_down_sum_cuda);
  m.impl("moe_gate_up_silu_fp8", &moe_gate_up_silu_fp8_cuda);
  m.impl("moe_down_sum_fp8", &moe_down_sum_fp8_cuda);
  m.impl("moe_gate_up_silu_int4", &moe_gate_up_silu_int4_cuda);
  m.impl("moe_down_sum_int4", &moe_down_sum_int4_cuda);
}

}  // namespace pagedkv
