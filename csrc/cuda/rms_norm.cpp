// CUDA launchers of rms_norm / fused_add_rms_norm: check, guard the device, launch on the
// current stream. The kernels live in csrc/kernels/rms_norm.cu.
#include <torch/library.h>

#include "checks.h"
#include "cuda/torch_utils.h"
#include "kernels/rms_norm.h"

namespace pagedkv {

void rms_norm_cuda(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                   double epsilon, bool gemma_style) {
  check_norm_args(out, "out", input, "input", weight, epsilon);
  check_cuda(input, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t hidden = input.size(-1);
  C10_CUDA_CHECK(kernels::rms_norm(out.data_ptr(), input.const_data_ptr(), weight.const_data_ptr(),
                                   input.numel() / hidden, static_cast<int>(hidden),
                                   static_cast<float>(epsilon), gemma_style, kernel_dtype(input),
                                   c10::cuda::getCurrentCUDAStream()));
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                             double epsilon, bool gemma_style) {
  check_norm_args(residual, "residual", input, "input", weight, epsilon);
  check_cuda(input, "input");
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t hidden = input.size(-1);
  C10_CUDA_CHECK(kernels::fused_add_rms_norm(
      input.data_ptr(), residual.data_ptr(), weight.const_data_ptr(), input.numel() / hidden,
      static_cast<int>(hidden), static_cast<float>(epsilon), gemma_style, kernel_dtype(input),
      c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cuda);
}

}  // namespace pagedkv
