// CUDA launcher of pagedkv::linear_nf4: the NF4 weight-streaming kernel (kernels/gemv_nf4.cu) or
// the dequantized weight and cuBLAS, as cuda/linear_dequant.h routes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/linear_dequant.h"
#include "cuda/torch_utils.h"
#include "kernels/gemv_nf4.h"
#include "linear_nf4_checks.h"

namespace pagedkv {

at::Tensor dequantize_nf4(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& code,
                          int64_t block_size);  // cpu/linear_nf4.cpp (ATen ops: any device)

void linear_nf4_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                     const at::Tensor& code, int64_t block_size) {
  check_linear_nf4_args(out, x, packed, absmax, code, block_size);
  const auto stream_kernel = [&](at::Tensor& out2, const at::Tensor& x2, cudaStream_t stream) {
    return kernels::gemv_nf4(out2.data_ptr(), x2.const_data_ptr(), x2.stride(0), packed.const_data_ptr<uint8_t>(),
                             absmax.const_data_ptr<float>(), code.const_data_ptr<float>(),
                             static_cast<int>(x2.size(0)), static_cast<int>(out2.size(1)),
                             static_cast<int>(x2.size(1)), static_cast<int>(block_size),
                             sm_count(x.device().index()), kernel_dtype(x), stream);
  };
  // The kernel reads 32 codes (16 bytes) at a time under one absmax: block_size a multiple of 32.
  const bool fits = block_size % 32 == 0 && block_size <= INT32_MAX;
  linear_dequant_cuda(out, x, packed, fits, stream_kernel,
                      [&] { return dequantize_nf4(packed, absmax, code, block_size); });
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("linear_nf4", &linear_nf4_cuda); }

}  // namespace pagedkv
