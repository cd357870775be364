// Argument checks of the paged attention ops: the cache-side contract that paged_decode_attention
// and paged_prefill_attention share, and the decode op's own (the prefill op's are in
// paged_prefill_attention_checks.h). Shared by the CPU and CUDA implementations so both reject a
// bad call with the same message.
#pragma once
#include <torch/types.h>

#include <cmath>
#include <optional>

#include "checks.h"

namespace pagedkv {

// The CPU op takes every multiple of 16 up to 256; CUDA a few of them (check_cuda_head_dim).
inline bool is_supported_head_dim(int64_t d) { return d >= 16 && d <= 256 && d % 16 == 0; }

// An fp8 KV cache (e4m3: x stored as round(clamp(x / scale, -448, 448)), read as float(x) *
// scale) next to a 16-bit or fp32 q. Its scales are one fp32 element each on q's device, read by
// the kernels at run time (CUDA graphs see new values); a 16-bit cache takes none.
inline bool is_fp8_cache(const at::Tensor& cache) { return cache.scalar_type() == at::kFloat8_e4m3fn; }

inline void check_kv_scales(const at::Tensor& k_cache, const at::Tensor& q,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  if (!is_fp8_cache(k_cache)) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "pagedkv: k_scale/v_scale were "
                "given for a ", k_cache.scalar_type(), " cache; they apply to a torch.float8_e4m3fn "
                "cache only (pass None)");
    return;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "pagedkv: the cache is "
              "torch.float8_e4m3fn; pass k_scale and v_scale (one-element float32 tensors on q's device)");
  for (const auto& [t, name] : {std::pair{&*k_scale, "k_scale"}, {&*v_scale, "v_scale"}}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == 1, "pagedkv: ", name, " has dtype ",
                t->scalar_type(), " and ", t->numel(), " elements; allowed: one torch.float32 element");
    check_same_device(*t, q, name, "q");
  }
}

// Attention sinks (GPT-OSS): None, or one fp32 logit per query head, contiguous, on q's device.
inline void check_sinks(const std::optional<at::Tensor>& sinks, const at::Tensor& q) {
  if (!sinks.has_value()) return;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == q.size(1) &&
                  sinks->is_contiguous(),
              "pagedkv: sinks has dtype ", sinks->scalar_type(), " and shape ", sinks->sizes(),
              "; allowed: a contiguous torch.float32 tensor of num_q_heads (", q.size(1), ") elements");
  check_same_device(*sinks, q, "sinks", "q");
}

// paged_decode_attention's row_order: a contiguous int32 [batch] tensor on q's device (the CPU also
// checks it is a permutation of the rows; CUDA trusts it, as it trusts block tables' contents).
inline void check_row_order(const std::optional<at::Tensor>& row_order, const at::Tensor& q) {
  if (!row_order.has_value()) return;
  TORCH_CHECK(row_order->scalar_type() == at::kInt && row_order->dim() == 1 && row_order->size(0) == q.size(0) &&
                  row_order->is_contiguous(),
              "pagedkv: row_order must be an int32 [batch] tensor, contiguous, got dtype ",
              row_order->scalar_type(), " and shape ", row_order->sizes());
  check_same_device(*row_order, q, "row_order", "q");
}

// The options both ops share: a sliding window of keys and a logit softcap, 0 = off.
inline void check_attention_options(int64_t sliding_window, double logit_softcap) {
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX, "pagedkv: sliding_window is ",
              sliding_window, "; allowed: 0 (none) or a positive number of keys below 2^31");
  TORCH_CHECK(logit_softcap >= 0.0 && std::isfinite(logit_softcap), "pagedkv: logit_softcap is ",
              logit_softcap, "; allowed: 0 (none) or a positive finite cap");
}

// The head dims the CUDA kernels are compiled for (the CPU op takes every multiple of 16 up to
// 256); sliding_window and logit_softcap they compute like the CPU op.
inline void check_cuda_head_dim(int64_t head_dim) {
  TORCH_CHECK(head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 ||
                  head_dim == 256,
              "pagedkv: q has head_dim ", head_dim,
              "; allowed on CUDA: 64, 80, 96, 128, 256 (the CPU op takes any multiple of 16 up to 256)");
}

// The contract both paged attention ops share. out, q: [rows, Hq, D] (head_dim contiguous; rows
// are sequences for decode, tokens for prefill, named by q_rows in messages); k_cache, v_cache:
// [num_blocks, block_size, Hkv, D], head_dim contiguous, the same strides; block_tables:
// [B, max_blocks] int32 with B = batch when batch >= 0 (decode: one row per q row);
// context_lens: [B] int32.
inline void check_paged_kv_args(const at::Tensor& out, const at::Tensor& q,
                                const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                const char* q_rows, int64_t batch) {
  check_float_dtype(q, "q");
  check_same_dtype(out, q, "out", "q");
  if (!is_fp8_cache(k_cache)) check_same_dtype(k_cache, q, "k_cache", "q");  // else check_kv_scales
  check_same_dtype(v_cache, k_cache, "v_cache", "k_cache");
  for (const auto& [t, name] : {std::pair{&out, "out"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"},
                                {&block_tables, "block_tables"}, {&context_lens, "context_lens"}}) {
    check_same_device(*t, q, name, "q");
  }
  TORCH_CHECK(q.dim() == 3, "pagedkv: q must have shape [", q_rows, ", num_q_heads, head_dim], got ",
              q.sizes());
  check_same_shape(out, q, "out", "q");
  TORCH_CHECK(k_cache.dim() == 4,
              "pagedkv: k_cache must have shape [num_blocks, block_size, num_kv_heads, head_dim], got ",
              k_cache.sizes());
  check_same_shape(v_cache, k_cache, "v_cache", "k_cache");
  const int64_t num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(is_supported_head_dim(head_dim), "pagedkv: q has head_dim ", head_dim,
              "; allowed: a multiple of 16 from 16 to 256");
  TORCH_CHECK(k_cache.size(3) == head_dim, "pagedkv: k_cache has head_dim ", k_cache.size(3),
              " but q has ", head_dim, "; they must match");
  TORCH_CHECK(block_size >= 8 && block_size <= 128 && (block_size & (block_size - 1)) == 0,
              "pagedkv: k_cache has block_size ", block_size,
              " (dim 1); allowed: a power of two from 8 to 128");
  TORCH_CHECK(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0, "pagedkv: q has ",
              num_q_heads, " heads and k_cache ", num_kv_heads,
              " kv heads; num_q_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1,
              "pagedkv: q and out must have a contiguous last (head_dim) dimension, got strides ",
              q.strides(), " and ", out.strides());
  // Any strides but head_dim's: a head-major store [num_blocks, Hkv, block_size, D] is passed as
  // its transpose(1, 2) view. K and V share theirs, so one set of strides reaches the kernels.
  TORCH_CHECK(k_cache.stride(3) == 1, "pagedkv: k_cache must have a contiguous last (head_dim) ",
              "dimension, got strides ", k_cache.strides());
  TORCH_CHECK(v_cache.strides() == k_cache.strides(), "pagedkv: v_cache has strides ",
              v_cache.strides(), " but k_cache has ", k_cache.strides(), "; they must match");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "pagedkv: block_tables has dtype ",
              block_tables.scalar_type(), "; allowed: torch.int32");
  if (batch >= 0) {
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                    block_tables.size(1) >= 1,
                "pagedkv: block_tables must have shape [batch, max_blocks] = [", batch,
                ", >= 1], got ", block_tables.sizes());
  } else {
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(1) >= 1,
                "pagedkv: block_tables must have shape [batch, max_blocks >= 1], got ",
                block_tables.sizes());
    batch = block_tables.size(0);
  }
  check_contiguous(block_tables, "block_tables");
  TORCH_CHECK(block_tables.size(1) * block_size <= INT32_MAX, "pagedkv: block_tables has ",
              block_tables.size(1), " columns of ", block_size,
              " tokens; at most 2^31 - 1 tokens per sequence");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt, "pagedkv: context_lens has dtype ",
              context_lens.scalar_type(), "; allowed: torch.int32");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == batch,
              "pagedkv: context_lens must have shape [batch] = [", batch,
              "] (block_tables' rows), got ", context_lens.sizes());
  check_contiguous(context_lens, "context_lens");
}

// An attention op's split workspace: fp32, contiguous, on q's device (its size is checked by the
// CUDA launcher, which knows the split count).
inline void check_workspace(const at::Tensor& workspace, const at::Tensor& q) {
  check_same_device(workspace, q, "workspace", "q");
  TORCH_CHECK(workspace.scalar_type() == at::kFloat, "pagedkv: workspace has dtype ",
              workspace.scalar_type(), "; allowed: torch.float32");
  check_contiguous(workspace, "workspace");
}

// paged_decode_attention: one query row per sequence (q: [B, Hq, D]); workspace: fp32 (size
// checked by the CUDA launcher, which knows the split count).
inline void check_paged_decode_args(const at::Tensor& out, const at::Tensor& q,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& block_tables,
                                    const at::Tensor& context_lens, const at::Tensor& workspace,
                                    int64_t num_splits) {
  TORCH_CHECK(q.dim() == 3, "pagedkv: q must have shape [batch, num_q_heads, head_dim], got ",
              q.sizes());
  check_paged_kv_args(out, q, k_cache, v_cache, block_tables, context_lens, "batch", q.size(0));
  check_workspace(workspace, q);
  TORCH_CHECK(num_splits >= 0 && num_splits <= 65536, "pagedkv: num_splits is ", num_splits,
              "; allowed: 0 (automatic) or 1..65536");
}

}  // namespace pagedkv
