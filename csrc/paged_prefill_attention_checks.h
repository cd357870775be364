// Argument checks of paged_prefill_attention, shared by the CPU and CUDA implementations so both
// reject a bad call with the same message. The cache-side checks are shared with the decode op
// (attention_checks.h).
#pragma once
#include <torch/types.h>

#include "attention_checks.h"

namespace pagedkv {

// out, q: [T, Hq, D] (head_dim contiguous); k_cache, v_cache: [num_blocks, block_size, Hkv, D];
// block_tables: [B, max_blocks] int32; context_lens: [B] int32; query_start_loc: [B + 1] int32.
inline void check_paged_prefill_args(const at::Tensor& out, const at::Tensor& q,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& block_tables,
                                     const at::Tensor& context_lens,
                                     const at::Tensor& query_start_loc, int64_t max_query_len,
                                     const std::optional<at::Tensor>& workspace) {
  check_paged_kv_args(out, q, k_cache, v_cache, block_tables, context_lens, "num_tokens", -1);
  check_same_device(query_start_loc, q, "query_start_loc", "q");
  const int64_t batch = block_tables.size(0);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt, "pagedkv: query_start_loc has dtype ",
              query_start_loc.scalar_type(), "; allowed: torch.int32");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == batch + 1,
              "pagedkv: query_start_loc must have shape [batch + 1] = [", batch + 1, "], got ",
              query_start_loc.sizes());
  check_contiguous(query_start_loc, "query_start_loc");
  TORCH_CHECK(q.size(0) <= INT32_MAX, "pagedkv: q has ", q.size(0),
              " tokens; at most 2^31 - 1");
  TORCH_CHECK(max_query_len >= 0 && max_query_len <= INT32_MAX, "pagedkv: max_query_len is ",
              max_query_len, "; allowed: 0 to 2^31 - 1 (an upper bound of every sequence's "
              "query_start_loc[b + 1] - query_start_loc[b])");
  if (workspace.has_value()) check_workspace(*workspace, q);
}

}  // namespace pagedkv
