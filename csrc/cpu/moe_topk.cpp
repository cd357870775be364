// CPU moe_topk: HF's router after its linear through the same ATen ops HF runs (fp32 softmax,
// topk, sum, divide), so on the CPU it gives HF's ids and weights bit for bit, ties included:
// torch.topk on the CPU orders equal probs by its partial sort, and only calling it reproduces
// that order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "moe_checks.h"

namespace pagedkv {

void moe_topk_cpu(at::Tensor& expert_ids, at::Tensor& weights, const at::Tensor& logits, bool normalize) {
  check_moe_topk_args(expert_ids, weights, logits);
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);  // [T, E]
  auto [top, ids] = at::topk(probs, expert_ids.size(1), -1);     // [T, k] fp32, int64
  if (normalize) top = top / top.sum(-1, /*keepdim=*/true);
  expert_ids.copy_(ids);
  weights.copy_(top);
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("moe_topk", &moe_topk_cpu); }

}  // namespace pagedkv
