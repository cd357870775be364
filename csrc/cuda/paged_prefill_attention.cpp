// CUDA launcher of paged_prefill_attention: check, guard the device, launch on the current
// stream. The kernel lives in csrc/kernels/paged_prefill_attention.cu. The metadata (tables,
// lengths, query_start_loc) stays on the device unread: no synchronisation, graph-capturable.
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernels/paged_prefill_attention.h"
#include "prefill_checks.h"

namespace pagedkv {
void paged_prefill_attention_cuda(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens,
                                  const at::Tensor& query_start_loc, double scale,
                                  int64_t max_query_len) {
  check_paged_prefill_args(out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           max_query_len);
  check_cuda(q, "q");
  const int64_t elem = q.element_size();
  TORCH_CHECK(aligned16(q.const_data_ptr()) && aligned16(out.const_data_ptr()) &&
                  (q.stride(0) * elem) % 16 == 0 && (q.stride(1) * elem) % 16 == 0 &&
                  (out.stride(0) * elem) % 16 == 0 && (out.stride(1) * elem) % 16 == 0,
              "pagedkv: q and out rows must start at 16-byte boundaries (strides ", q.strides(),
              " and ", out.strides(), "); call .contiguous() first");
  TORCH_CHECK(aligned16(k_cache.const_data_ptr()) && aligned16(v_cache.const_data_ptr()),
              "pagedkv: k_cache and v_cache must start at 16-byte boundaries");
  if (q.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());

  kernels::PagedPrefillArgs args{};
  args.out = out.data_ptr();
  args.q = q.const_data_ptr();
  args.k_cache = k_cache.const_data_ptr();
  args.v_cache = v_cache.const_data_ptr();
  args.block_tables = block_tables.const_data_ptr<int>();
  args.context_lens = context_lens.const_data_ptr<int>();
  args.query_start_loc = query_start_loc.const_data_ptr<int>();
  args.out_stride_t = out.stride(0);
  args.out_stride_h = out.stride(1);
  args.q_stride_t = q.stride(0);
  args.q_stride_h = q.stride(1);
  args.num_tokens = static_cast<int>(q.size(0));
  args.batch = static_cast<int>(block_tables.size(0));
  args.num_q_heads = static_cast<int>(q.size(1));
  args.num_kv_heads = static_cast<int>(k_cache.size(2));
  args.head_dim = static_cast<int>(q.size(2));
  args.block_size = static_cast<int>(k_cache.size(1));
  args.max_blocks = static_cast<int>(block_tables.size(1));
  args.max_query_len = static_cast<int>(max_query_len);
  args.scale = static_cast<float>(scale);
  C10_CUDA_CHECK(kernels::paged_prefill_attention(args, kernel_dtype(q),
                                                  c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention_cuda);
}

}  // namespace pagedkv
