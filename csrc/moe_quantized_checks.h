// Argument checks of the quantized experts' ops (moe_gate_up_silu_fp8 / _int4, moe_down_sum_fp8 /
// _int4: a quantized checkpoint's experts as stored), shared by the CPU and CUDA implementations so
// both reject a bad call with the same message. The rest of each call is checked as its dense
// op's (moe_checks.h).
#pragma once
#include <vector>

#include "checks.h"
#include "moe_checks.h"

namespace pagedkv {

// The kernels read 16 bytes of activations under one scale at a time (kernels::kMoeQuantAlign).
constexpr int64_t kMoeQuantAlign = 16;

// One FP8 projection of every expert: weight [E, n, k] float8_e4m3fn, contiguous; scales [E,
// ceil(n / block_n), ceil(k / block_k)] float32, contiguous; both on x's (x_name's) device; k and block_k
// multiples of kMoeQuantAlign.
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
  TORCH_CHECK(block_n > 0 && block_k > 0 && block_k % kMoeQuantAlign == 0 && k % kMoeQuantAlign == 0,
              "pagedkv: ", name, ": block (", block_n, ", ", block_k, ") over ", k, " input columns; allowed: "
              "block_n >= 1, block_k and the input columns multiples of ", kMoeQuantAlign);
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

// One int4 projection of every expert: packed [E, n, k / 2] uint8 (two values a byte, the even
// column in the low nibble), scales [E, n, k / g] float32/float16/bfloat16, zeros [E, n, k / g]
// uint8, contiguous, on x's (x_name's) device; k and g multiples of kMoeQuantAlign, k of g.
inline void check_int4_experts(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& zeros,
                               const at::Tensor& x, const char* x_name, const char* name, int64_t num_experts,
                               int64_t n, int64_t k, int64_t group_size) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, "pagedkv: ", name, " (packed) has dtype ", packed.scalar_type(),
              "; it must be torch.uint8 (two int4 values a byte)");
  check_same_device(packed, x, name, x_name);
  TORCH_CHECK(group_size > 0 && group_size % kMoeQuantAlign == 0 && k % kMoeQuantAlign == 0 && k % group_size == 0,
              "pagedkv: ", name, ": group_size ", group_size, " over ", k, " input columns; allowed: group_size and "
              "the input columns multiples of ", kMoeQuantAlign, ", the columns a multiple of group_size");
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == num_experts && packed.size(1) == n && packed.size(2) == k / 2,
              "pagedkv: ", name, " (packed) must have shape [num_experts, ", n, ", ", k / 2, "] with num_experts = ",
              num_experts, ", got ", packed.sizes());
  check_contiguous(packed, name);
  const std::vector<int64_t> groups = {num_experts, n, k / group_size};
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf ||
              scales.scalar_type() == at::kBFloat16, "pagedkv: the scales of ", name, " have dtype ",
              scales.scalar_type(), "; allowed: torch.float32, torch.float16, torch.bfloat16");
  check_same_device(scales, x, "scales", x_name);
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(groups), "pagedkv: the scales of ", name,
              " must be [num_experts, n, k / group_size] = ", groups, ", got ", scales.sizes());
  check_contiguous(scales, "scales");
  TORCH_CHECK(zeros.scalar_type() == at::kByte, "pagedkv: the zeros of ", name, " have dtype ", zeros.scalar_type(),
              "; they must be torch.uint8");
  check_same_device(zeros, x, "zeros", x_name);
  TORCH_CHECK(zeros.sizes() == at::IntArrayRef(groups), "pagedkv: the zeros of ", name,
              " must be [num_experts, n, k / group_size] = ", groups, ", got ", zeros.sizes());
  check_contiguous(zeros, "zeros");
}

// out [T, k, I], x [T, D], gate and up [E, I, D / 2] packed with their scales and zeros, expert_ids [T, k].
inline void check_moe_gate_up_silu_int4_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& gate,
                                             const at::Tensor& gate_scales, const at::Tensor& gate_zeros,
                                             const at::Tensor& up, const at::Tensor& up_scales,
                                             const at::Tensor& up_zeros, const at::Tensor& expert_ids,
                                             int64_t group_size) {
  check_moe_gate_up_x(x, expert_ids);
  TORCH_CHECK(gate.dim() == 3, "pagedkv: gate must have shape [num_experts, intermediate, hidden / 2], got ",
              gate.sizes());
  const int64_t num_experts = gate.size(0), inter = gate.size(1);
  check_int4_experts(gate, gate_scales, gate_zeros, x, "x", "gate", num_experts, inter, x.size(1), group_size);
  check_int4_experts(up, up_scales, up_zeros, x, "x", "up", num_experts, inter, x.size(1), group_size);
  TORCH_CHECK(gate_scales.scalar_type() == up_scales.scalar_type(), "pagedkv: the scales of gate (",
              gate_scales.scalar_type(), ") and of up (", up_scales.scalar_type(), ") must have one dtype");
  check_moe_gate_up_out(out, x, expert_ids, inter);
}

// out [T, D], act [T, k, I], down [E, D, I / 2] packed with its scales and zeros, expert_ids and weights [T, k].
inline void check_moe_down_sum_int4_args(const at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                                         const at::Tensor& down_scales, const at::Tensor& down_zeros,
                                         const at::Tensor& expert_ids, const at::Tensor& weights,
                                         int64_t group_size) {
  TORCH_CHECK(down.dim() == 3, "pagedkv: down must have shape [num_experts, hidden, intermediate / 2], got ",
              down.sizes());
  check_moe_down_sum_inputs(out, act, down.size(1), expert_ids, weights);
  check_int4_experts(down, down_scales, down_zeros, act, "act", "down", down.size(0), down.size(1), act.size(2),
                     group_size);
}

}  // namespace pagedkv
