// Host side of the arguments both paged attention launchers (decode, prefill) share.
#pragma once
#include <torch/types.h>

#include "attention_checks.h"
#include "cuda/torch_utils.h"
#include "kernels/paged_attention_args.h"
#include "kernels/paged_decode_attention_fp8.h"
#include "kernels/paged_decode_attention_plan.h"

namespace pagedkv {

// Checks what the kernels' 16-byte vector loads need (rows of q and out, both caches) and fills
// the shared fields from tensors the op's checks have already validated: out, q [rows, Hq, D],
// caches [num_blocks, block_size, Hkv, D] (head_dim contiguous), block_tables [batch, max_blocks].
inline void fill_paged_attention_args(kernels::PagedAttentionArgs& args, at::Tensor& out,
                                      const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, double scale,
                                      int64_t sliding_window, double logit_softcap,
                                      const std::optional<at::Tensor>& sinks,
                                      const std::optional<at::Tensor>& k_scale,
                                      const std::optional<at::Tensor>& v_scale) {
  const int64_t elem = q.element_size();
  TORCH_CHECK(aligned16(q.const_data_ptr()) && aligned16(out.const_data_ptr()) &&
                  (q.stride(0) * elem) % 16 == 0 && (q.stride(1) * elem) % 16 == 0 &&
                  (out.stride(0) * elem) % 16 == 0 && (out.stride(1) * elem) % 16 == 0,
              "pagedkv: q and out rows must start at 16-byte boundaries (strides ", q.strides(),
              " and ", out.strides(), "); call .contiguous() first");
  const int64_t cache_elem = k_cache.element_size();  // 1 for an fp8 cache
  TORCH_CHECK(aligned16(k_cache.const_data_ptr()) && aligned16(v_cache.const_data_ptr()) &&
                  (k_cache.stride(0) * cache_elem) % 16 == 0 &&
                  (k_cache.stride(1) * cache_elem) % 16 == 0 &&
                  (k_cache.stride(2) * cache_elem) % 16 == 0,
              "pagedkv: k_cache and v_cache rows must start at 16-byte boundaries (strides ",
              k_cache.strides(), ")");
  args.out = out.data_ptr();
  args.q = q.const_data_ptr();
  args.k_cache = k_cache.const_data_ptr();
  args.v_cache = v_cache.const_data_ptr();
  args.block_tables = block_tables.const_data_ptr<int>();
  args.context_lens = context_lens.const_data_ptr<int>();
  args.out_stride_row = out.stride(0);
  args.out_stride_h = out.stride(1);
  args.q_stride_row = q.stride(0);
  args.q_stride_h = q.stride(1);
  args.cache_stride_block = k_cache.stride(0);
  args.cache_stride_token = k_cache.stride(1);
  args.cache_stride_head = k_cache.stride(2);
  args.batch = static_cast<int>(block_tables.size(0));
  args.num_q_heads = static_cast<int>(q.size(1));
  args.num_kv_heads = static_cast<int>(k_cache.size(2));
  args.head_dim = static_cast<int>(q.size(2));
  args.block_size = static_cast<int>(k_cache.size(1));
  args.max_blocks = static_cast<int>(block_tables.size(1));
  args.scale = static_cast<float>(scale);
  args.sliding_window = static_cast<int>(sliding_window);
  args.logit_softcap = static_cast<float>(logit_softcap);
  args.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;  // check_sinks has run
  // check_kv_scales has run: both present for an fp8 cache, absent otherwise
  args.k_scale = k_scale.has_value() ? k_scale->const_data_ptr<float>() : nullptr;
  args.v_scale = v_scale.has_value() ? v_scale->const_data_ptr<float>() : nullptr;
}

// Whether an fp8 cache goes to the simple kernel below rather than the 16-bit kernels' tensor-core
// paths, which take it (converting as they read) only at the decode kernel's tensor-core shapes:
// 16-bit q at head_dim 64, 128 or 256 (the shapes the CUDA tests cover).
inline bool fp8_cache_takes_simple_kernel(const at::Tensor& q, const at::Tensor& k_cache) {
  return is_fp8_cache(k_cache) && !kernels::paged_decode_tensor_cores(static_cast<int>(q.size(2)),
                                                                      static_cast<int>(q.element_size()));
}

// An fp8 (e4m3) cache where fp8_cache_takes_simple_kernel: the simple kernel of
// kernels/paged_decode_attention_fp8.h, for both ops (query_start_loc null: decode). The op's
// checks (check_kv_scales) have run.
inline void launch_paged_attention_fp8(at::Tensor& out, const at::Tensor& q,
                                       const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables,
                                       const at::Tensor& context_lens,
                                       const at::Tensor* query_start_loc, double scale,
                                       int64_t sliding_window, double logit_softcap,
                                       const at::Tensor& k_scale, const at::Tensor& v_scale,
                                       const std::optional<at::Tensor>& sinks) {
  kernels::PagedFp8Args args{};
  fill_paged_attention_args(args, out, q, k_cache, v_cache, block_tables, context_lens, scale,
                            sliding_window, logit_softcap, sinks, k_scale, v_scale);
  args.query_start_loc = query_start_loc ? query_start_loc->const_data_ptr<int>() : nullptr;
  args.num_rows = static_cast<int>(q.size(0));
  const c10::cuda::CUDAGuard guard(q.device());
  C10_CUDA_CHECK(kernels::paged_attention_fp8(args, kernel_dtype(q), c10::cuda::getCurrentCUDAStream()));
}

// The kernels' view of a split workspace whose size the launcher has checked: null when the
// launch needs none, else its data, which the kernels read as float2/float4.
inline float* workspace_data(const at::Tensor& workspace, int64_t needed) {
  if (needed == 0) return nullptr;
  TORCH_CHECK(aligned16(workspace.const_data_ptr()),
              "pagedkv: workspace must start at a 16-byte boundary");
  return workspace.data_ptr<float>();
}

}  // namespace pagedkv
