// CUDA launcher of paged_prefill_attention: check, guard the device, launch on the current
// stream. The kernel lives in csrc/kernels/paged_prefill_attention.cu. The metadata (tables,
// lengths, query_start_loc) stays on the device unread: no synchronisation, graph-capturable.
#include <cuda_runtime_api.h>
#include <string>
#include <torch/library.h>

#include "cuda/paged_attention_args.h"
#include "cuda/torch_utils.h"
#include "kernels/paged_prefill_attention.h"
#include "paged_prefill_attention_checks.h"

namespace pagedkv {
void paged_prefill_attention_cuda(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens,
                                  const at::Tensor& query_start_loc, double scale,
                                  int64_t max_query_len,
                                  const std::optional<at::Tensor>& workspace,
                                  int64_t sliding_window, double logit_softcap,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale,
                                  const std::optional<at::Tensor>& sinks) {
  check_paged_prefill_args(out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           max_query_len, workspace);
  check_kv_scales(k_cache, q, k_scale, v_scale);
  check_sinks(sinks, q);
  check_attention_options(sliding_window, logit_softcap);
  check_cuda_head_dim(q.size(2));
  check_cuda(q, "q");
  if (q.size(0) == 0) return;
  if (fp8_cache_takes_simple_kernel(q, k_cache)) {  // no key splits: a workspace is not needed
    launch_paged_attention_fp8(out, q, k_cache, v_cache, block_tables, context_lens,
                               &query_start_loc, scale, sliding_window, logit_softcap, *k_scale,
                               *v_scale, sinks);
    return;
  }
  const c10::cuda::CUDAGuard guard(q.device());

  kernels::PagedPrefillArgs args{};
  fill_paged_attention_args(args, out, q, k_cache, v_cache, block_tables, context_lens, scale,
                            sliding_window, logit_softcap, sinks, k_scale, v_scale);
  args.query_start_loc = query_start_loc.const_data_ptr<int>();
  args.num_tokens = static_cast<int>(q.size(0));
  args.max_query_len = static_cast<int>(max_query_len);
  args.num_sms = sm_count(q.device().index());
  const int64_t splits = kernels::paged_prefill_num_splits(
      q.size(0), block_tables.size(0), max_query_len, q.size(1), k_cache.size(2), q.size(2),
      q.element_size(), block_tables.size(1) * k_cache.size(1), args.num_sms);
  const int64_t needed =
      kernels::paged_prefill_workspace_floats(q.size(0), q.size(1), q.size(2), splits);
  const int64_t given = workspace.has_value() ? workspace->numel() : 0;
  TORCH_CHECK(given >= needed, "pagedkv: paged_prefill_attention splits these shapes' keys ",
              splits, " ways and needs a workspace of ", needed, " floats, got ",
              workspace.has_value() ? std::to_string(given) : std::string("none"),
              "; allocate it with pagedkv.ops.paged_prefill_workspace(q, k_cache, block_tables, "
              "max_query_len)");
  args.num_splits = static_cast<int>(splits);
  args.workspace = needed > 0 ? workspace_data(*workspace, needed) : nullptr;
  C10_CUDA_CHECK(kernels::paged_prefill_attention(args, kernel_dtype(q),
                                                  c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention_cuda);
}

}  // namespace pagedkv
