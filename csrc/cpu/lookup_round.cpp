// CPU lookup_propose and lookup_accept: the rule of csrc/kernels/lookup_round_rule.h, a loop over
// rows (the n-gram search scans start positions in order and stops at the first match).
#include <torch/library.h>

#include "kernels/lookup_round_rule.h"
#include "lookup_round_checks.h"

namespace pagedkv {
namespace {

void propose_row(const kernels::LookupPropose& a, int64_t b) {
  const int64_t length = kernels::clamp_length(a.lengths[b], a.max_length);
  const int64_t cap = a.done[b] ? 0 : kernels::proposal_cap(a, b);
  const int64_t* tokens = a.history + b * a.max_length;
  int64_t src = 0, proposed = 0;
  for (int64_t n = cap > 0 ? kernels::longest_ngram(a, length) : 0; n >= 1 && proposed == 0; --n) {
    for (int64_t s = 0; s < length - n; ++s) {
      if (kernels::ngram_at(tokens, length, n, s)) {
        src = s + n;
        proposed = kernels::min64(cap, length - src);
        break;
      }
    }
  }
  a.proposal_lens[b] = proposed;
  for (int j = 0; j < a.width; ++j) kernels::write_fed_slot(a, b, length, src, proposed, j);
}

}  // namespace

void lookup_propose_cpu(const at::Tensor& history, const at::Tensor& lengths,
                        const at::Tensor& generated, const at::Tensor& done,
                        const at::Tensor& block_tables, const at::Tensor& feed,
                        const at::Tensor& proposal_lens, const at::Tensor& positions,
                        const at::Tensor& slot_mapping, const at::Tensor& context_lens,
                        const at::Tensor& max_new, int64_t k, int64_t max_ngram, int64_t block_size) {
  const kernels::LookupPropose a = checked_lookup_propose(
      history, lengths, generated, done, block_tables, feed, proposal_lens, positions,
      slot_mapping, context_lens, max_new, k, max_ngram, block_size);
  for (int64_t b = 0; b < a.rows; ++b) propose_row(a, b);
}

void lookup_accept_cpu(const at::Tensor& greedy, const at::Tensor& feed,
                       const at::Tensor& proposal_lens, const at::Tensor& eos_ids,
                       const at::Tensor& history, const at::Tensor& lengths,
                       const at::Tensor& generated, const at::Tensor& done, const at::Tensor& stats,
                       const at::Tensor& max_new) {
  const kernels::LookupAccept a = checked_lookup_accept(
      greedy, feed, proposal_lens, eos_ids, history, lengths, generated, done, stats, max_new);
  for (int64_t b = 0; b < a.rows; ++b) kernels::accept_row(a, b);
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("lookup_propose", &lookup_propose_cpu);
  m.impl("lookup_accept", &lookup_accept_cpu);
}

}  // namespace pagedkv
