// Argument checks of moe_gate_up_silu, moe_down_sum and moe_topk, shared by the CPU and CUDA
// implementations so both reject a bad call with the same message.
#pragma once
#include <algorithm>

#include "checks.h"

namespace pagedkv {

// expert_ids [T, k] int64 (torch.topk's indices), contiguous, on x's device.
inline void check_expert_ids(const at::Tensor& expert_ids, const at::Tensor& x, int64_t num_tokens) {
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong, "pagedkv: expert_ids has dtype ",
              expert_ids.scalar_type(), "; it must be torch.int64 (torch.topk's indices)");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == num_tokens && expert_ids.size(1) > 0,
              "pagedkv: expert_ids must have shape [num_tokens, top_k] = [", num_tokens,
              ", k >= 1], got ", expert_ids.sizes());
  check_contiguous(expert_ids, "expert_ids");
  check_same_device(expert_ids, x, "expert_ids", "x");
}

// A [E, N, K] stack of expert weights, each expert's [N, K] contiguous (HF's 3D parameters).
inline void check_experts(const at::Tensor& w, const at::Tensor& x, const char* name, int64_t n, int64_t k) {
  check_same_dtype(w, x, name, "x");
  check_same_device(w, x, name, "x");
  TORCH_CHECK(w.dim() == 3 && w.size(0) > 0 && w.size(1) == n && w.size(2) == k, "pagedkv: ", name,
              " must have shape [num_experts, ", n, ", ", k, "], got ", w.sizes());
  check_contiguous(w, name);
}

// Everything of a moe_gate_up_silu call but its weights: out [T, k, I], x [T, D], expert_ids
// [T, k]. Shared with the quantized experts' ops (moe_quantized_checks.h).
inline void check_moe_gate_up_x(const at::Tensor& x, const at::Tensor& expert_ids) {
  check_float_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2, "pagedkv: x must have shape [num_tokens, hidden], got ", x.sizes());
  check_contiguous(x, "x");
  check_expert_ids(expert_ids, x, x.size(0));
}

inline void check_moe_gate_up_out(const at::Tensor& out, const at::Tensor& x, const at::Tensor& expert_ids,
                                  int64_t inter) {
  check_same_dtype(out, x, "out", "x");
  check_same_device(out, x, "out", "x");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == x.size(0) && out.size(1) == expert_ids.size(1) &&
              out.size(2) == inter, "pagedkv: out must have shape [num_tokens, top_k, intermediate] = [",
              x.size(0), ", ", expert_ids.size(1), ", ", inter, "], got ", out.sizes());
  check_contiguous(out, "out");
}

// out [T, k, I], x [T, D], gate_up [E, 2I, D], expert_ids [T, k].
inline void check_moe_gate_up_silu_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& gate_up,
                                        const at::Tensor& expert_ids) {
  check_moe_gate_up_x(x, expert_ids);
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(1) % 2 == 0, "pagedkv: gate_up must have shape "
              "[num_experts, 2 * intermediate, hidden], got ", gate_up.sizes());
  const int64_t inter = gate_up.size(1) / 2;
  check_experts(gate_up, x, "gate_up", 2 * inter, x.size(1));
  check_moe_gate_up_out(out, x, expert_ids, inter);
}

// Everything of a moe_down_sum call but its down weights: out [T, D], act [T, k, I], expert_ids
// [T, k], weights [T, k] (float32 or act's dtype: HF rounds each weighted expert output to the
// weights' dtype). Shared with the quantized experts' ops (moe_quantized_checks.h).
inline void check_moe_down_sum_inputs(const at::Tensor& out, const at::Tensor& act, int64_t hidden,
                                      const at::Tensor& expert_ids, const at::Tensor& weights) {
  check_float_dtype(act, "act");
  TORCH_CHECK(act.dim() == 3, "pagedkv: act must have shape [num_tokens, top_k, intermediate], got ",
              act.sizes());
  check_contiguous(act, "act");
  check_expert_ids(expert_ids, act, act.size(0));
  TORCH_CHECK(expert_ids.size(1) == act.size(1), "pagedkv: expert_ids has ", expert_ids.size(1),
              " experts a token and act ", act.size(1), "; they must match");
  TORCH_CHECK(weights.scalar_type() == at::kFloat || weights.scalar_type() == act.scalar_type(),
              "pagedkv: weights has dtype ", weights.scalar_type(), "; allowed: torch.float32 or act's ",
              act.scalar_type());
  check_same_shape(weights, expert_ids, "weights", "expert_ids");
  check_contiguous(weights, "weights");
  check_same_device(weights, act, "weights", "act");
  check_same_dtype(out, act, "out", "act");
  check_same_device(out, act, "out", "act");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == act.size(0) && out.size(1) == hidden,
              "pagedkv: out must have shape [num_tokens, hidden] = [", act.size(0), ", ", hidden, "], got ",
              out.sizes());
  check_contiguous(out, "out");
}

// out [T, D], act [T, k, I], down [E, D, I], expert_ids [T, k], weights [T, k].
inline void check_moe_down_sum_args(const at::Tensor& out, const at::Tensor& act, const at::Tensor& down,
                                    const at::Tensor& expert_ids, const at::Tensor& weights) {
  TORCH_CHECK(down.dim() == 3, "pagedkv: down must have shape [num_experts, hidden, intermediate], got ",
              down.sizes());
  check_moe_down_sum_inputs(out, act, down.size(1), expert_ids, weights);
  check_experts(down, act, "down", down.size(1), act.size(2));
}

// expert_ids [T, k] int64, weights [T, k] (float32 or logits' dtype), logits [T, E]; E at most
// kMoeTopkMaxExperts (the CUDA kernel keeps a token's E probs in shared memory), 1 <= k <=
// min(E, kMoeTopkMaxK) (one warp holds the k picks, one a lane).
inline void check_moe_topk_args(const at::Tensor& expert_ids, const at::Tensor& weights,
                                const at::Tensor& logits) {
  constexpr int64_t kMaxExperts = 4096;  // kernels::kMoeTopkMaxExperts (kernels/moe_topk.h)
  constexpr int64_t kMaxK = 32;          // kernels::kMoeTopkMaxK
  check_float_dtype(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "pagedkv: logits must have shape [num_tokens, num_experts], got ",
              logits.sizes());
  TORCH_CHECK(logits.size(1) >= 1 && logits.size(1) <= kMaxExperts, "pagedkv: logits has ", logits.size(1),
              " experts; allowed: 1 to ", kMaxExperts);
  check_contiguous(logits, "logits");
  check_expert_ids(expert_ids, logits, logits.size(0));
  const int64_t max_k = std::min(logits.size(1), kMaxK);
  TORCH_CHECK(expert_ids.size(1) <= max_k, "pagedkv: top_k (expert_ids.shape[1]) is ", expert_ids.size(1),
              "; allowed: 1 to ", max_k, " (the logits' ", logits.size(1), " experts, and at most ", kMaxK,
              ")");
  TORCH_CHECK(weights.scalar_type() == at::kFloat || weights.scalar_type() == logits.scalar_type(),
              "pagedkv: weights has dtype ", weights.scalar_type(), "; allowed: torch.float32 or logits' ",
              logits.scalar_type());
  check_same_shape(weights, expert_ids, "weights", "expert_ids");
  check_contiguous(weights, "weights");
  check_same_device(weights, logits, "weights", "logits");
}

}  // namespace pagedkv
