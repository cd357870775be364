// lookup_propose: one block per row. For each n from the longest, the block's threads test start
// positions s = tid, tid + blockDim, ... and the smallest matching s is a shared-memory atomicMin;
// the first n with a match wins (the rule of lookup_round_rule.h, whose CPU loop scans s in order).
// Then the threads write the row's width fed slots. lookup_accept: accept_row, one thread per row.
#include <climits>

#include "kernels/dependent_launch.cuh"
#include "kernels/lookup_round.h"

namespace pagedkv::kernels {
namespace {

constexpr int kProposeThreads = 256;
constexpr int kAcceptThreads = 128;

__global__ void __launch_bounds__(kProposeThreads) lookup_propose_kernel(const LookupPropose a) {
  begin_dependent_kernel();
  const int64_t b = blockIdx.x;
  __shared__ int first;  // the smallest matching start of the current n; INT_MAX: none yet
  const int64_t length = clamp_length(a.lengths[b], a.max_length);
  const int64_t cap = a.done[b] ? 0 : proposal_cap(a, b);  // the same for every thread
  const int64_t* tokens = a.history + b * a.max_length;
  if (threadIdx.x == 0) first = INT_MAX;
  __syncthreads();
  int64_t src = 0, proposed = 0;
  for (int64_t n = cap > 0 ? longest_ngram(a, length) : 0; n >= 1; --n) {
    for (int64_t s = threadIdx.x; s < length - n; s += kProposeThreads) {
      // A smaller match already found makes every later s of this thread moot (first only
      // decreases, so a stale read only scans a little longer).
      if (s > *static_cast<volatile int*>(&first)) break;
      if (ngram_at(tokens, length, n, s)) {
        atomicMin(&first, static_cast<int>(s));
        break;  // this thread's later s are larger
      }
    }
    __syncthreads();
    const int start = first;
    __syncthreads();  // everyone has read first before a next n may write it
    if (start != INT_MAX) {
      src = start + n;
      proposed = min64(cap, length - src);
      break;
    }
  }
  if (threadIdx.x == 0) a.proposal_lens[b] = proposed;
  for (int j = threadIdx.x; j < a.width; j += kProposeThreads) write_fed_slot(a, b, length, src, proposed, j);
}

__global__ void __launch_bounds__(kAcceptThreads) lookup_accept_kernel(const LookupAccept a) {
  begin_dependent_kernel();
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kAcceptThreads + threadIdx.x;
  if (b < a.rows) accept_row(a, b);
}

}  // namespace

cudaError_t lookup_propose(const LookupPropose& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  launch_dependent(lookup_propose_kernel, static_cast<unsigned>(args.rows), kProposeThreads, 0, stream, args);
  return cudaGetLastError();
}

cudaError_t lookup_accept(const LookupAccept& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((args.rows + kAcceptThreads - 1) / kAcceptThreads);
  launch_dependent(lookup_accept_kernel, blocks, kAcceptThreads, 0, stream, args);
  return cudaGetLastError();
}

}  // namespace pagedkv::kernels
