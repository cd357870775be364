// CUDA launcher of pagedkv::linear_fp8_weight: the FP8 weight-streaming kernel
// (kernels/gemv_fp8.cu) or the dequantized weight and cuBLAS, as cuda/linear_dequant.h routes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/linear_dequant.h"
#include "kernels/gemv_fp8.h"
#include "linear_fp8_checks.h"

namespace pagedkv {

at::Tensor dequantize_fp8(const at::Tensor& weight, const at::Tensor& scales, int64_t block_n,
                          int64_t block_k);  // cpu/linear_fp8.cpp (ATen ops: any device)

void linear_fp8_weight_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                            int64_t block_n, int64_t block_k) {
  check_linear_fp8_args(out, x, weight, scales, block_n, block_k);
  const auto stream_kernel = [&](at::Tensor& out2, const at::Tensor& x2, cudaStream_t stream) {
    return kernels::gemv_fp8(out2.data_ptr(), x2.const_data_ptr(), x2.stride(0),
                             static_cast<const uint8_t*>(weight.const_data_ptr()), scales.const_data_ptr<float>(),
                             static_cast<int>(x2.size(0)), static_cast<int>(out2.size(1)),
                             static_cast<int>(x2.size(1)), static_cast<int>(block_n), static_cast<int>(block_k),
                             kernel_dtype(x), stream);
  };
  // The kernel reads 16 weights (16 bytes) at a time under one scale: k and block_k multiples of 16.
  const bool fits = x.size(-1) % 16 == 0 && block_k % 16 == 0 && block_n <= INT32_MAX && block_k <= INT32_MAX;
  linear_dequant_cuda(out, x, weight, fits, stream_kernel,
                      [&] { return dequantize_fp8(weight, scales, block_n, block_k); });
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("linear_fp8_weight", &linear_fp8_weight_cuda); }

}  // namespace pagedkv
