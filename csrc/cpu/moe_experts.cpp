// CPU moe_gate_up_silu and moe_down_sum: each (token, chosen expert) pair is one matrix-vector
// product with that expert's weights through ATen, rounded as HF's grouped experts forward rounds.
// Their FP8 and int4 forms dequantize the chosen experts to the activations' dtype (one fp32
// product a value, rounded once: layers/moe_quantized.py's dequantize_experts) and run the same
// code on them, so each gives its dense op's bits on the dequantized weights.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <unordered_map>

#include "moe_checks.h"
#include "moe_quantized_checks.h"

namespace pagedkv {

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& x);  // cpu/silu_and_mul.cpp
at::Tensor dequantize_fp8(const at::Tensor& weight, const at::Tensor& scales, int64_t block_n,
                          int64_t block_k);  // cpu/linear_fp8.cpp

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

// The distinct experts of expert_ids [T, k] (checked), in first-use order [U] int64, and
// expert_ids as places in that list [T, k].
std::pair<at::Tensor, at::Tensor> distinct_experts(const at::Tensor& expert_ids, int64_t num_experts) {
  const std::vector<int64_t> ids = expert_list(expert_ids, num_experts);
  std::unordered_map<int64_t, int64_t> place;
  std::vector<int64_t> distinct, local;
  for (int64_t e : ids) {
    const auto [it, added] = place.emplace(e, static_cast<int64_t>(distinct.size()));
    if (added) distinct.push_back(e);
    local.push_back(it->second);
  }
  const auto options = expert_ids.options();
  return {at::tensor(distinct, options), at::tensor(local, options).view(expert_ids.sizes())};
}

// Experts `experts` [U] of an FP8 projection weight [E, n, k] dequantized: [U, n, k] in dtype, each
// value's fp32 product rounded once.
at::Tensor dequantize_fp8_experts(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& experts,
                                  int64_t block_n, int64_t block_k, at::ScalarType dtype) {
  return dequantize_fp8(weight.index_select(0, experts), scales.index_select(0, experts), block_n, block_k).to(dtype);
}

// Experts `experts` [U] of an int4 projection (packed [E, n, k / 2], scales and zeros [E, n, k / g])
// dequantized: [U, n, k] in dtype, each value (q - zero) * scale in fp32, rounded once.
at::Tensor dequantize_int4_experts(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                                   const at::Tensor& experts, int64_t group_size, at::ScalarType dtype) {
  const at::Tensor p = packed.index_select(0, experts);  // [U, n, k / 2]
  const int64_t count = p.size(0), n = p.size(1), k = 2 * p.size(2);
  const at::Tensor q = at::stack({p.bitwise_and(0xF), p.bitwise_right_shift(4)}, -1)
                           .view({count, n, k / group_size, group_size}).to(at::kFloat);  // even column low
  const at::Tensor z = zeros.index_select(0, experts).unsqueeze(-1).to(at::kFloat);
  const at::Tensor s = scales.index_select(0, experts).unsqueeze(-1).to(at::kFloat);
  return ((q - z) * s).to(dtype).view({count, n, k});
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

void moe_gate_up_silu_fp8_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate,
                              const at::Tensor& gate_scales, const at::Tensor& up, const at::Tensor& up_scales,
                              const at::Tensor& expert_ids, int64_t block_n, int64_t block_k) {
  check_moe_gate_up_silu_fp8_args(out, x, gate, gate_scales, up, up_scales, expert_ids, block_n, block_k);
  const auto [experts, local_ids] = distinct_experts(expert_ids, gate.size(0));
  const at::Tensor gate_up = at::cat({dequantize_fp8_experts(gate, gate_scales, experts, block_n, block_k, x.scalar_type()),
                                      dequantize_fp8_experts(up, up_scales, experts, block_n, block_k, x.scalar_type())},
                                     1);  // [U, 2I, D]
  moe_gate_up_silu_cpu(out, x, gate_up, local_ids);
}

void moe_down_sum_fp8_cpu(at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                          const at::Tensor& down_scales, const at::Tensor& expert_ids, const at::Tensor& weights,
                          int64_t block_n, int64_t block_k) {
  check_moe_down_sum_fp8_args(out, act, down, down_scales, expert_ids, weights, block_n, block_k);
  const auto [experts, local_ids] = distinct_experts(expert_ids, down.size(0));
  moe_down_sum_cpu(out, act, dequantize_fp8_experts(down, down_scales, experts, block_n, block_k, act.scalar_type()),
                   local_ids, weights);
}

void moe_gate_up_silu_int4_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& gate,
                               const at::Tensor& gate_scales, const at::Tensor& gate_zeros, const at::Tensor& up,
                               const at::Tensor& up_scales, const at::Tensor& up_zeros, const at::Tensor& expert_ids,
                               int64_t group_size) {
  check_moe_gate_up_silu_int4_args(out, x, gate, gate_scales, gate_zeros, up, up_scales, up_zeros, expert_ids,
                                   group_size);
  const auto [experts, local_ids] = distinct_experts(expert_ids, gate.size(0));
  const at::ScalarType dtype = x.scalar_type();
  const at::Tensor gate_up = at::cat({dequantize_int4_experts(gate, gate_scales, gate_zeros, experts, group_size, dtype),
                                      dequantize_int4_experts(up, up_scales, up_zeros, experts, group_size, dtype)},
                                     1);  // [U, 2I, D]
  moe_gate_up_silu_cpu(out, x, gate_up, local_ids);
}

void moe_down_sum_int4_cpu(at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                           const at::Tensor& down_scales, const at::Tensor& down_zeros, const at::Tensor& expert_ids,
                           const at::Tensor& weights, int64_t group_size) {
  check_moe_down_sum_int4_args(out, act, down, down_scales, down_zeros, expert_ids, weights, group_size);
  const auto [experts, local_ids] = distinct_experts(expert_ids, down.size(0));
  moe_down_sum_cpu(out, act,
                   dequantize_int4_experts(down, down_scales, down_zeros, experts, group_size, act.scalar_type()),
                   local_ids, weights);
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("moe_gate_up_silu", &moe_gate_up_silu_cpu);
  m.impl("moe_down_sum", &moe_down_sum_cpu);
  m.impl("moe_gate_up_silu_fp8", &moe_gate_up_silu_fp8_cpu);
  m.impl("moe_down_sum_fp8", &moe_down_sum_fp8_cpu);
  m.impl("moe_gate_up_silu_int4", &moe_gate_up_silu_int4_cpu);
  m.impl("moe_down_sum_int4", &moe_down_sum_int4_cpu);
}

}  // namespace pagedkv
