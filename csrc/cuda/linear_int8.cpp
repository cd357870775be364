// CUDA launcher of pagedkv::linear_int8: the int8 weight-streaming kernel (kernels/gemv_int8.cu)
// or the dequantized weight and cuBLAS, as cuda/linear_dequant.h routes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/linear_dequant.h"
#include "cuda/torch_utils.h"
#include "kernels/gemv_int8.h"
#include "linear_int8_checks.h"

namespace pagedkv {

at::Tensor dequantize_int8(const at::Tensor& q, const at::Tensor& scb);  // cpu/linear_int8.cpp (any device)

void linear_int8_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scb) {
  check_linear_int8_args(out, x, q, scb);
  const auto stream_kernel = [&](at::Tensor& out2, const at::Tensor& x2, cudaStream_t stream) {
    return kernels::gemv_int8(out2.data_ptr(), x2.const_data_ptr(), x2.stride(0), q.const_data_ptr<int8_t>(),
                              scb.const_data_ptr<float>(), static_cast<int>(x2.size(0)),
                              static_cast<int>(out2.size(1)), static_cast<int>(x2.size(1)), kernel_dtype(x), stream);
  };
  // The kernel reads 16 columns (16 bytes) at a time: k a multiple of 16.
  const bool fits = q.size(1) % 16 == 0 && q.size(1) <= INT32_MAX && q.size(0) <= INT32_MAX;
  linear_dequant_cuda(out, x, q, fits, stream_kernel, [&] { return dequantize_int8(q, scb); });
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("linear_int8", &linear_int8_cuda); }

}  // namespace pagedkv
