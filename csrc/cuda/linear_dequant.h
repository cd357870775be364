// The routing shared by the CUDA launchers of the quantized linears (linear_w4a16, linear_fp8,
// linear_nf4): 1..kGemvDequantMaxRows rows of aligned 16-bit x go to the format's
// weight-streaming kernel (kernels/gemv_dequant.cuh), anything else to the weight dequantized to
// x's dtype (a temporary) and cuBLAS through ATen.
#pragma once
#include <cstdint>

#include <ATen/ATen.h>

#include "cuda/torch_utils.h"
#include "kernels/gemv_dequant.h"

namespace pagedkv {

// out [..., n] = x [..., k] @ W^T, the arguments already checked by the format. weight: the
// streamed tensor ([n, ...] 16-byte aligned); fits: the format's own size conditions for its
// kernel; stream_kernel(out2 [m, n], x2 [m, k], stream) -> cudaError_t; dequantize() -> [n, k].
template <typename StreamKernel, typename Dequantize>
void linear_dequant_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, bool fits,
                         StreamKernel&& stream_kernel, Dequantize&& dequantize) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = x.size(-1);
  const int64_t n = weight.size(0);
  const int64_t m = x.numel() / k;
  const at::Tensor x2 = x.reshape({m, k});
  at::Tensor out2 = out.view({m, n});
  const bool streams = fits && x2.element_size() == 2 && m <= kernels::kGemvDequantMaxRows &&
                       x2.stride(0) % 8 == 0 && aligned16(x2.data_ptr()) && aligned16(weight.data_ptr());
  if (streams) {
    C10_CUDA_CHECK(stream_kernel(out2, x2, c10::cuda::getCurrentCUDAStream()));
  } else {
    at::mm_out(out2, x2, dequantize().to(x.scalar_type()).t());
  }
}

}  // namespace pagedkv
