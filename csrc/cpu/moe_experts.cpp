// CPU moe_gate_up_silu and moe_down_sum: each (token, chosen expert) pair is one matrix-vector
// product with that expert's weights through ATen, rounded as HF's grouped experts forward rounds.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "moe_checks.h"

namespace pagedkv {

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& x);  // cpu/silu_and_mul.cpp

namespace {

// The ids as host integers, each checked to name one of the num_experts experts.
std::vector<int64_t> expert_list(const at::Tensor& expert_ids, int64_t num_experts) {
  const int64_t* ids = expert_ids.const_data_ptr<int64_t>();
  std::vector<int64_t> list(ids, ids + expert_ids.numel());
  for (int64_t e : list) {
    TORCH_CHECK(e >= 0 && e < num_experts, "pagedkv: expert_ids holds ", e, "; allowed: 0 to ",
                num_experts - 1, " (the experts of the weight)");
  }
  return list;
}

}  // namespace

void moe_gate_up_silu_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                          const at::Tensor& expert_ids) {
  check_moe_gate_up_silu_args(out, x, gate_up, expert_ids);
  const std::vector<int64_t> ids = expert_list(expert_ids, gate_up.size(0));
  const int64_t top_k = expert_ids.size(1);
  at::Tensor projected = at::empty({out.size(0), top_k, gate_up.size(1)}, out.options());  // [T, k, 2I]
  for (int64_t p = 0; p < static_cast<int64_t>(ids.size()); ++p) {
    at::Tensor row = projected.select(0, p / top_k).select(0, p % top_k);
    at::mv_out(row, gate_up.select(0, ids[p]), x.select(0, p / top_k));
  }
  silu_and_mul_cpu(out, projected);
}

void moe_down_sum_cpu(at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                      const at::Tensor& expert_ids, const at::Tensor& weights) {
  check_moe_down_sum_args(out, act, down, expert_ids, weights);
  const std::vector<int64_t> ids = expert_list(expert_ids, down.size(0));
  const int64_t top_k = expert_ids.size(1);
  for (int64_t t = 0; t < out.size(0); ++t) {
    at::Tensor sum = at::zeros({out.size(1)}, out.options().dtype(at::kFloat));  // fp32, as HF's sum
    for (int64_t j = 0; j < top_k; ++j) {
      // The expert's output in the model dtype, times its weight rounded to the weights' dtype
      // (a 0-dim product would not promote, so both go to fp32 explicitly).
      const at::Tensor y = at::mv(down.select(0, ids[t * top_k + j]), act.select(0, t).select(0, j));
      const at::Tensor w = weights.select(0, t).select(0, j).to(at::kFloat);
      sum.add_((y.to(at::kFloat) * w).to(weights.scalar_type()).to(at::kFloat));
    }
    out.select(0, t).copy_(sum);
  }
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("moe_gate_up_silu", &moe_gate_up_silu_cpu);
  m.impl("moe_down_sum", &moe_down_sum_cpu);
}

}  // namespace pagedkv
