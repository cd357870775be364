// CPU moe_route: HF's router through the same ATen ops HF runs (mm, fp32 softmax, topk, sum,
// divide), so on the CPU it gives HF's ids and weights bit for bit, ties included: torch.topk on
// the CPU orders equal probs by its partial sort, not by expert index, and only calling it
// reproduces that order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "moe_checks.h"

namespace pagedkv {

void moe_route_cpu(at::Tensor& expert_ids, at::Tensor& weights, const at::Tensor& x, const at::Tensor& router,
                   bool normalize) {
  check_moe_route_args(expert_ids, weights, x, router);
  const at::Tensor logits = at::mm(x, router.t());  // [T, E], x's dtype (pagedkv::linear's CPU path)
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [top, ids] = at::topk(probs, expert_ids.size(1), -1);  // [T, k] fp32, int64
  if (normalize) top = top / top.sum(-1, /*keepdim=*/true);
  expert_ids.copy_(ids);
  weights.copy_(top);
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("moe_route", &moe_route_cpu); }

}  // namespace pagedkv
