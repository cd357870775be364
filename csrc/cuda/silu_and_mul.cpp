// CUDA launcher of silu_and_mul: check, guard the device, launch on the current stream. The
// kernel lives in csrc/kernels/silu_and_mul.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernel_checks.h"
#include "kernels/silu_and_mul.h"

namespace pagedkv {

void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& x, c10::string_view activation) {
  const bool gelu_tanh = is_gelu_tanh(activation);
  check_silu_and_mul_args(out, x);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t intermediate = out.size(-1);
  C10_CUDA_CHECK(kernels::silu_and_mul(out.data_ptr(), x.const_data_ptr(), out.numel() / intermediate,
                                       intermediate, gelu_tanh, kernel_dtype(x),
                                       c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("silu_and_mul", &silu_and_mul_cuda); }

}  // namespace pagedkv
