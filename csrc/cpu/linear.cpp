// CPU pagedkv::linear (out = x @ weight^T + bias) and pagedkv::gate_up_silu (that GEMM, then
// silu_and_mul) through ATen.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "linear_checks.h"

namespace pagedkv {

void linear_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  check_linear_args(out, x, weight, bias);
  const int64_t k = x.size(-1);
  const at::Tensor x2 = x.reshape({-1, k});
  at::Tensor out2 = out.view({x2.size(0), weight.size(0)});
  if (bias) {
    at::addmm_out(out2, *bias, x2, weight.t());
  } else {
    at::mm_out(out2, x2, weight.t());
  }
}

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& x,
                      c10::string_view activation);  // cpu/silu_and_mul.cpp

void gate_up_silu_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                      c10::string_view activation) {
  check_gate_up_silu_args(out, x, gate_up);
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  std::vector<int64_t> gate_up_shape = out.sizes().vec();  // [..., 2 * i]
  gate_up_shape.back() *= 2;
  silu_and_mul_cpu(out, at::mm(x2, gate_up.t()).view(gate_up_shape), activation);
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("linear", &linear_cpu);
  m.impl("gate_up_silu", &gate_up_silu_cpu);
}

}  // namespace pagedkv
