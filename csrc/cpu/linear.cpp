// CPU pagedkv::linear (out = x @ weight^T + bias) through ATen.
#include <ATen/ATen.h>
#include <torch/library.h>

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

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("linear", &linear_cpu); }

}  // namespace pagedkv
