// CUDA launcher of pagedkv::linear_w4a16: the int4 weight-streaming kernel
// (kernels/gemv_w4a16.cu) for up to kGemvW4A16MaxRows rows of 16-bit x, otherwise the weight
// dequantized to x's dtype (a temporary) and cuBLAS through ATen.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernels/gemv_w4a16.h"
#include "linear_w4a16_checks.h"

namespace pagedkv {

at::Tensor dequantize_w4a16(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                            int64_t group_size);  // cpu/linear_w4a16.cpp (ATen ops: any device)

void linear_w4a16_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size) {
  check_linear_w4a16_args(out, x, packed, scales, zeros, group_size);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = x.size(-1);
  const int64_t n = packed.size(0);
  const int64_t m = x.numel() / k;
  const at::Tensor x2 = x.reshape({m, k});
  at::Tensor out2 = out.view({m, n});
  const bool streams = x2.element_size() == 2 && m <= kernels::kGemvW4A16MaxRows && x2.stride(0) % 8 == 0 &&
                       aligned16(x2.data_ptr()) && aligned16(packed.data_ptr());
  if (streams) {
    C10_CUDA_CHECK(kernels::gemv_w4a16(out2.data_ptr(), x2.const_data_ptr(), x2.stride(0),
                                       packed.const_data_ptr<int32_t>(), scales.const_data_ptr(),
                                       zeros.const_data_ptr<uint8_t>(), static_cast<int>(m), static_cast<int>(n),
                                       static_cast<int>(k), static_cast<int>(group_size), kernel_dtype(x),
                                       kernel_dtype(scales), c10::cuda::getCurrentCUDAStream()));
  } else {
    at::mm_out(out2, x2, dequantize_w4a16(packed, scales, zeros, group_size).to(x.scalar_type()).t());
  }
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("linear_w4a16", &linear_w4a16_cuda); }

}  // namespace pagedkv
