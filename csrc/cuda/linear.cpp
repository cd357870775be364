// CUDA launchers of pagedkv::linear and pagedkv::gate_up_silu for 16-bit activations: the
// CUDA-core weight-streaming kernel (kernels/gemv.cu) for up to kGemvMaxRows rows, the
// tensor-core one (kernels/gemv_mma.cu) up to kGemvMmaMaxRows, cuBLAS through ATen otherwise.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernel_checks.h"
#include "kernels/gemv.h"
#include "linear_checks.h"

namespace pagedkv {
namespace {

enum class Path { kGemv, kGemvMma, kCublas };

// The weight-streaming kernels take 16-bit x with 16-byte rows: <= kGemvMaxRows rows on CUDA
// cores, <= kGemvMmaMaxRows on tensor cores (past one n-tile only for small matrices).
Path gemv_path(const at::Tensor& x2, const at::Tensor& weight) {
  const bool fits = x2.element_size() == 2 && x2.size(1) % 8 == 0 && x2.stride(0) % 8 == 0 &&
                    aligned16(x2.data_ptr()) && aligned16(weight.data_ptr());
  const bool wide = x2.size(0) > kernels::kGemvMmaTileRows &&
                    weight.numel() * weight.element_size() >= kernels::kGemvMmaWideBytes;
  if (!fits || wide || x2.size(0) > kernels::kGemvMmaMaxRows) return Path::kCublas;
  return x2.size(0) <= kernels::kGemvMaxRows ? Path::kGemv : Path::kGemvMma;
}

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
  const Path path = gemv_path(x2, weight);
  if (path == Path::kGemvMma) {  // bias is read one element at a time: any alignment
    C10_CUDA_CHECK(kernels::gemv_mma(out2.data_ptr(), x2.const_data_ptr(), x2.stride(0),
                                     weight.const_data_ptr(), bias ? bias->const_data_ptr() : nullptr,
                                     static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                     kernels::GatedAct::kNone, kernel_dtype(x),
                                     c10::cuda::getCurrentCUDAStream()));
  } else if (path == Path::kGemv) {
    C10_CUDA_CHECK(kernels::gemv(out2.data_ptr(), x2.const_data_ptr(), x2.stride(0),
                                 weight.const_data_ptr(), bias ? bias->const_data_ptr() : nullptr,
                                 static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                 kernels::GatedAct::kNone, kernel_dtype(x),
                                 c10::cuda::getCurrentCUDAStream()));
  } else if (bias) {
    at::addmm_out(out2, *bias, x2, weight.t());
  } else {
    at::mm_out(out2, x2, weight.t());
  }
}

void silu_and_mul_cuda(at::Tensor& out, const at::Tensor& x,
                       c10::string_view activation);  // cuda/silu_and_mul.cpp

void gate_up_silu_cuda(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                       c10::string_view activation) {
  const kernels::GatedAct act =
      is_gelu_tanh(activation) ? kernels::GatedAct::kGeluTanh : kernels::GatedAct::kSilu;
  check_gate_up_silu_args(out, x, gate_up);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t k = x.size(-1);
  const int64_t i = gate_up.size(0) / 2;
  const int64_t m = x.numel() / k;
  const at::Tensor x2 = x.reshape({m, k});
  const Path path = gemv_path(x2, gate_up);
  if (path == Path::kGemvMma) {
    C10_CUDA_CHECK(kernels::gemv_mma(out.data_ptr(), x2.const_data_ptr(), x2.stride(0),
                                     gate_up.const_data_ptr(), nullptr, static_cast<int>(m),
                                     static_cast<int>(i), static_cast<int>(k), act,
                                     kernel_dtype(x), c10::cuda::getCurrentCUDAStream()));
  } else if (path == Path::kGemv) {
    C10_CUDA_CHECK(kernels::gemv(out.data_ptr(), x2.const_data_ptr(), x2.stride(0),
                                 gate_up.const_data_ptr(), nullptr, static_cast<int>(m),
                                 static_cast<int>(i), static_cast<int>(k), act, kernel_dtype(x),
                                 c10::cuda::getCurrentCUDAStream()));
  } else {
    std::vector<int64_t> gate_up_shape = out.sizes().vec();  // [..., 2 * i]
    gate_up_shape.back() *= 2;
    silu_and_mul_cuda(out, at::mm(x2, gate_up.t()).view(gate_up_shape), activation);
  }
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("linear", &linear_cuda);
  m.impl("gate_up_silu", &gate_up_silu_cuda);
}

}  // namespace pagedkv
