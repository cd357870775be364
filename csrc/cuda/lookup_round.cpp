// CUDA launchers of lookup_propose and lookup_accept: check, guard the device, launch on the
// current stream. The kernels live in csrc/kernels/lookup_round.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernels/lookup_round.h"
#include "lookup_round_checks.h"

namespace pagedkv {

void lookup_propose_cuda(const at::Tensor& history, const at::Tensor& lengths,
                         const at::Tensor& generated, const at::Tensor& done,
                         const at::Tensor& block_tables, const at::Tensor& feed,
                         const at::Tensor& proposal_lens, const at::Tensor& positions,
                         const at::Tensor& slot_mapping, const at::Tensor& context_lens,
                         const at::Tensor& max_new, int64_t k, int64_t max_ngram, int64_t block_size) {
  const kernels::LookupPropose args = checked_lookup_propose(
      history, lengths, generated, done, block_tables, feed, proposal_lens, positions,
      slot_mapping, context_lens, max_new, k, max_ngram, block_size);
  check_cuda(feed, "feed");
  const c10::cuda::CUDAGuard guard(feed.device());
  C10_CUDA_CHECK(kernels::lookup_propose(args, c10::cuda::getCurrentCUDAStream()));
}

void lookup_accept_cuda(const at::Tensor& greedy, const at::Tensor& feed,
                        const at::Tensor& proposal_lens, const at::Tensor& eos_ids,
                        const at::Tensor& history, const at::Tensor& lengths,
                        const at::Tensor& generated, const at::Tensor& done, const at::Tensor& stats,
                        const at::Tensor& max_new) {
  const kernels::LookupAccept args = checked_lookup_accept(
      greedy, feed, proposal_lens, eos_ids, history, lengths, generated, done, stats, max_new);
  check_cuda(feed, "feed");
  const c10::cuda::CUDAGuard guard(feed.device());
  C10_CUDA_CHECK(kernels::lookup_accept(args, c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("lookup_propose", &lookup_propose_cuda);
  m.impl("lookup_accept", &lookup_accept_cuda);
}

}  // namespace pagedkv
