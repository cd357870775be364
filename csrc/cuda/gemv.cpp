// CUDA launcher of pagedkv::linear: the weight-streaming kernel (csrc/kernels/gemv.cu) for up to
// kGemvMaxRows rows of 16-bit activations, cuBLAS through ATen (into `out`) otherwise.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernels/gemv.h"
#include "linear_checks.h"

namespace pagedkv {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void linear_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  check_linear_args(out, x, weight, bias);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = x.size(-1);
  const int64_t n = weight.size(0);
  const int64_t m = x.numel() / k;
  const at::Tensor x2 = x.reshape({m, k});  // a view: the last dim is contiguous (checked)
  at::Tensor out2 = out.view({m, n});
  const bool kernel_fits = m <= kernels::kGemvMaxRows && x.element_size() == 2 && k % 8 == 0 &&
                           x2.stride(0) % 8 == 0 && aligned16(x2.data_ptr()) &&
                           aligned16(weight.data_ptr()) &&
                           true;  // bias is read one element at a time: any alignment
  if (kernel_fits) {
    C10_CUDA_CHECK(kernels::gemv(out2.data_ptr(), x2.const_data_ptr(), x2.stride(0),
                                 weight.const_data_ptr(), bias ? bias->const_data_ptr() : nullptr,
                                 static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                 kernel_dtype(x), c10::cuda::getCurrentCUDAStream()));
  } else if (bias) {
    at::addmm_out(out2, *bias, x2, weight.t());
  } else {
    at::mm_out(out2, x2, weight.t());
  }
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("linear", &linear_cuda); }

}  // namespace pagedkv
