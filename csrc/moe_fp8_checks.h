// Argument checks of moe_gate_up_silu_fp8 and moe_down_sum_fp8 (the FP8 experts of a quantized
// checkpoint), shared by the CPU and CUDA implementations so both reject a bad call with the same
// message. The rest of each call is checked as its dense op's (moe_checks.h).
#pragma once
#include <vector>

#include "checks.h"
#include "moe_checks.h"

namespace pagedkv {

// The kernels read 16 e4m3 values under one scale at a time (kernels::kMoeFp8Align).
constexpr int64_t kMoeFp8Align = 16;

// One FP8 projection of every expert: weight [E, n, k] float8_e4m3fn, contiguous; scales [E,
// ceil(n / block_n), ceil(k / block_k)] float32, contiguous; both on x's (x_name's) device; k and block_k
// multiples of kMoeFp8Align.
inline void check_fp8_experts(const at::Tensor& weight, const at::Tensor& scales, const at::Tensor& x,
                              const char* x_name, const char* name, int64_t num_experts, int64_t n, int64_t k, int64_t block_n,
                              int64_t block_k) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, "pagedkv: ", name, " has dtype ",
              weight.scalar_type(), "; it must be torch.float8_e4m3fn");
  check_same_device(weight, x, name, x_name);
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == num_experts && weight.size(1) == n && weight.size(2) == k,
              "pagedkv: ", name, " must have shape [num_experts, ", n, ", ", k, "] with num_experts = ",
              num_experts, ", got ", weight.sizes());
  check_contiguous(weight, name);
  TORCH_CHECK(block_n > 0 && block_k > 0 && block_k % kMoeFp8Align == 0 && k % kMoeFp8Align == 0,
              "pagedkv: ", name, ": block (", block_n, ", ", block_k, ") over ", k, " input columns; allowed: "
              "block_n >= 1, block_k and the input columns multiples of ", kMoeFp8Align);
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "pagedkv: the scales of ", name, " have dtype ",
              scales.scalar_type(), "; they must be torch.float32");
  check_same_device(scales, x, "scales", x_name);
  const std::vector<int64_t> grid = {num_experts, (n + block_n - 1) / block_n, (k + block_k - 1) / block_k};
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(grid), "pagedkv: the scales of ", name,
              " must be [num_experts, ceil(n / block_n), ceil(k / block_k)] = ", grid, ", got ", scales.sizes());
  check_contiguous(scales, "scales");
}

// out [T, k, I], x [T, D], gate and up [E, I, D] e4m3 with their scales, expert_ids [T, k].
inline void check_moe_gate_up_silu_fp8_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& gate,
                                            const at::Tensor& gate_scales, const at::Tensor& up,
                                            const at::Tensor& up_scales, const at::Tensor& expert_ids,
                                            int64_t block_n, int64_t block_k) {
  check_moe_gate_up_x(x, expert_ids);
  TORCH_CHECK(gate.dim() == 3, "pagedkv: gate must have shape [num_experts, intermediate, hidden], got ",
              gate.sizes());
  const int64_t num_experts = gate.size(0), inter = gate.size(1);
  check_fp8_experts(gate, gate_scales, x, "x", "gate", num_experts, inter, x.size(1), block_n, block_k);
  check_fp8_experts(up, up_scales, x, "x", "up", num_experts, inter, x.size(1), block_n, block_k);
  check_moe_gate_up_out(out, x, expert_ids, inter);
}

// out [T, D], act [T, k, I], down [E, D, I] e4m3 with its scales, expert_ids and weights [T, k].
inline void check_moe_down_sum_fp8_args(const at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                                        const at::Tensor& down_scales, const at::Tensor& expert_ids,
                                        const at::Tensor& weights, int64_t block_n, int64_t block_k) {
  TORCH_CHECK(down.dim() == 3, "pagedkv: down must have shape [num_experts, hidden, intermediate], got ",
              down.sizes());
  check_moe_down_sum_inputs(out, act, down.size(1), expert_ids, weights);
  check_fp8_experts(down, down_scales, act, "act", "down", down.size(0), down.size(1), act.size(2), block_n, block_k);
}

}  // namespace pagedkv
