// CUDA launcher of pagedkv::linear_w4a16: the int4 weight-streaming kernel
// (kernels/gemv_w4a16.cu) or the dequantized weight and cuBLAS, as cuda/linear_dequant.h routes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/linear_dequant.h"
#include "cuda/torch_utils.h"
#include "kernels/gemv_w4a16.h"
#include "linear_w4a16_checks.h"

namespace pagedkv {

at::Tensor dequantize_w4a16(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                            int64_t group_size);  // cpu/linear_w4a16.cpp (ATen ops: any device)

void linear_w4a16_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size) {
  check_linear_w4a16_args(out, x, packed, scales, zeros, group_size);
  const auto stream_kernel = [&](at::Tensor& out2, const at::Tensor& x2, cudaStream_t stream) {
    return kernels::gemv_w4a16(out2.data_ptr(), x2.const_data_ptr(), x2.stride(0), packed.const_data_ptr<int32_t>(),
                               scales.const_data_ptr(), zeros.const_data_ptr(), zeros.scalar_type() != at::kByte,
                               static_cast<int>(x2.size(0)), static_cast<int>(out2.size(1)),
                               static_cast<int>(x2.size(1)), static_cast<int>(group_size),
                               sm_count(x.device().index()), kernel_dtype(x), kernel_dtype(scales), stream);
  };
  // The checks already make group_size a multiple of 32 (one group per 16-byte piece) dividing k.
  linear_dequant_cuda(out, x, packed, true, stream_kernel,
                      [&] { return dequantize_w4a16(packed, scales, zeros, group_size); });
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("linear_w4a16", &linear_w4a16_cuda); }

}  // namespace pagedkv
