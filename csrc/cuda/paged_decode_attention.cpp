// CUDA launcher of paged_decode_attention: check, choose the split count from shapes, guard the
// device, launch on the current stream. The kernels live in
// csrc/kernels/paged_decode_attention.cu.
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "attention_checks.h"
#include "cuda/paged_attention_args.h"
#include "cuda/torch_utils.h"
#include "kernels/paged_decode_attention.h"

namespace pagedkv {
namespace {

// The automatic split count: shapes and the SM count only, never context_lens.
int64_t auto_num_splits(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& block_tables, int num_sms) {
  const bool tensor_cores = kernels::paged_decode_tensor_cores(
      static_cast<int>(q.size(2)), static_cast<int>(q.element_size()));
  return kernels::paged_decode_num_splits(q.size(0), q.size(1), k_cache.size(2), k_cache.size(1),
                                          block_tables.size(1), num_sms, tensor_cores, q.size(2));
}

}  // namespace

void paged_decode_attention_cuda(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, double scale,
                                 at::Tensor& workspace, int64_t num_splits,
                                 int64_t sliding_window, double logit_softcap,
                                 const std::optional<at::Tensor>& k_scale,
                                 const std::optional<at::Tensor>& v_scale,
                                 const std::optional<at::Tensor>& sinks,
                                 const std::optional<at::Tensor>& row_order) {
  check_paged_decode_args(out, q, k_cache, v_cache, block_tables, context_lens, workspace,
                          num_splits);
  check_row_order(row_order, q);
  check_kv_scales(k_cache, q, k_scale, v_scale);
  check_sinks(sinks, q);
  check_attention_options(sliding_window, logit_softcap);
  check_cuda_head_dim(q.size(2));
  check_cuda(q, "q");
  if (fp8_cache_takes_simple_kernel(q, k_cache)) {  // no splits: the workspace is not used
    launch_paged_attention_fp8(out, q, k_cache, v_cache, block_tables, context_lens, nullptr,
                               scale, sliding_window, logit_softcap, *k_scale, *v_scale, sinks);
    return;
  }
  kernels::PagedDecodeArgs args{};
  fill_paged_attention_args(args, out, q, k_cache, v_cache, block_tables, context_lens, scale,
                            sliding_window, logit_softcap, sinks, k_scale, v_scale);
  const c10::cuda::CUDAGuard guard(q.device());
  const int num_sms = sm_count(q.device().index());
  if (num_splits == 0) num_splits = auto_num_splits(q, k_cache, block_tables, num_sms);
  const int64_t needed =
      kernels::paged_decode_workspace_floats(q.size(0), q.size(1), q.size(2), num_splits);
  TORCH_CHECK(workspace.numel() >= needed, "pagedkv: workspace has ", workspace.numel(),
              " floats but ", num_splits, " splits need ", needed,
              "; allocate it with pagedkv.ops.paged_decode_workspace(q, k_cache, block_tables)");
  args.workspace = workspace_data(workspace, needed);
  args.num_splits = static_cast<int>(num_splits);
  args.num_sms = num_sms;
  args.row_order = row_order ? row_order->const_data_ptr<int>() : nullptr;
  C10_CUDA_CHECK(kernels::paged_decode_attention(args, kernel_dtype(q),
                                                 c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_cuda);
}

}  // namespace pagedkv
