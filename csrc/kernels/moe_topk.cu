// The router's tail, one block per token, written to give what torch's own CUDA kernels give HF:
//  - softmax as torch's warp softmax (PersistentSoftmax.cuh, E <= 1024): lane l holds experts
//    l, l + 32, ...; its exps summed in that order from 0, then a butterfly over the lanes; each
//    exp divided by the sum. --use_fast_math is on for the kernels, so the exp is libdevice's
//    accurate __nv_expf (torch's std::exp, up to flushing denormal results) and the divisions
//    are __fdiv_rn.
//  - topk as torch.topk on CUDA (TensorTopK.cu, then Sort.cu's SmallBitonicSort for k <= 32):
//    the set is every prob above the k-th largest plus the lowest-index ones equal to it; they
//    are gathered (the larger ones by index, then the equal ones by index) and sorted by a
//    bitonic network of 32 whose compare-exchange also swaps equal probs, so the order of ties
//    is that network's, which the warp runs here one element a lane.
//  - the renormalising sum as torch.sum of [T, k] over k (Reduce.cuh): lane x < w = the largest
//    power of two <= k adds elements x and x + w, then a shuffle-down tree with offsets 1, 2, 4..
#include <cmath>
#include <climits>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/moe_topk.h"

extern "C" __device__ float __nv_expf(float);  // libdevice's expf, the accurate one

namespace pagedkv::kernels {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(kFull, x, offset);
    x = x < other ? other : x;  // torch's Max
  }
  return x;
}

// torch.topk's ranking: NaN above everything (its radix order), then the larger value.
__device__ __forceinline__ bool greater(float a, float b) {
  return isnan(b) ? false : (isnan(a) || a > b);
}

// Whether (a, expert ia) is picked before (b, expert ib): the greater, then the lower expert.
// A strict total order, so every lane of a warp reduction agrees on the winner.
__device__ __forceinline__ bool picked_before(float a, int ia, float b, int ib) {
  if (greater(a, b)) return true;
  if (greater(b, a)) return false;
  return ia < ib;
}

// Up to this many experts, each is ranked by a thread of its own (E compares, all threads at once:
// ~E^2 / 128 issue slots an SM sub-partition); above, warp 0 picks by k rounds of warp argmax
// (~k (E / 32 + 40) dependent steps). At E = 128, k = 8 the ranks take about a fifth of the rounds.
constexpr int kRankMaxExperts = 256;

// A prob's place in torch.topk's order as one integer, larger first: the prob, then the lower
// expert. Softmax probs are +0 or above, or NaN, so a number's bits order like it; every NaN ties
// with every other and ranks above all numbers (`greater`), so all take the top bits.
__device__ __forceinline__ uint64_t pick_key(float p, int e) {
  const uint32_t bits = isnan(p) ? 0xffffffffu : __float_as_uint(p);
  return (static_cast<uint64_t>(bits) << 32) | (0xffffffffu - static_cast<uint32_t>(e));
}

// Softmax, torch's warp softmax, by one warp. Expert e belongs to lane e % 32, which alone touches
// probs[e].
template <typename T>
__device__ __forceinline__ void warp_softmax(float* probs, const T* row, int num_experts, int lane) {
  float max_logit = -INFINITY;
  for (int e = lane; e < num_experts; e += 32) {
    const float logit = to_float(row[e]);
    probs[e] = logit;
    max_logit = max_logit < logit ? logit : max_logit;
  }
  max_logit = warp_max(max_logit);
  float sum = 0.f;
  for (int e = lane; e < num_experts; e += 32) {
    const float p = __nv_expf(probs[e] - max_logit);
    probs[e] = p;
    sum += p;
  }
  sum = warp_sum(sum);
  for (int e = lane; e < num_experts; e += 32) probs[e] = __fdiv_rn(probs[e], sum);
}

// k rounds of warp argmax over probs (which it marks -1 once picked): lane j returns round j's
// pick, so lanes 0..k-1 hold the top k in descending order, equal probs by expert index.
__device__ __forceinline__ void warp_argmax_rounds(float* probs, int num_experts, int top_k, int lane,
                                                   float& prob, int& id) {
  for (int j = 0; j < top_k; ++j) {
    float best = -2.f;  // below every prob and below a picked expert's -1
    int best_e = INT_MAX;
    for (int e = lane; e < num_experts; e += 32) {
      if (picked_before(probs[e], e, best, best_e)) {
        best = probs[e];
        best_e = e;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(kFull, best, offset);
      const int other_e = __shfl_xor_sync(kFull, best_e, offset);
      if (picked_before(other, other_e, best, best_e)) {
        best = other;
        best_e = other_e;
      }
    }
    if (lane == best_e % 32) probs[best_e] = -1.f;
    if (lane == j) {
      prob = best;
      id = best_e;
    }
  }
}

// The k picked (lanes 0..k-1, descending, equal probs by index) put in torch.topk's output order:
// where two of them are equal, its bitonic sort's order of ties; else the descending order as is.
__device__ __forceinline__ void torch_tie_order(float& prob, int& id, int top_k, int lane, float* gathered_prob,
                                                int* gathered_id) {
  const float next = __shfl_down_sync(kFull, prob, 1);
  const bool ties_next = lane + 1 < top_k && (next == prob || (isnan(next) && isnan(prob)));
  if (!__any_sync(kFull, ties_next)) return;  // distinct keys: every sort gives the one order

  // torch's gathered order: the probs above the k-th (lanes 0..g-1) by expert index, then the
  // ones equal to it (lanes g..k-1, already by index).
  const float kth = __shfl_sync(kFull, prob, top_k - 1);
  const bool above = lane < top_k && greater(prob, kth);
  const int num_above = __popc(__ballot_sync(kFull, above));
  int rank = 0;  // among the ones above, by expert index
  for (int i = 0; i < num_above; ++i) rank += __shfl_sync(kFull, id, i) < id;
  const int position = above ? rank : lane;
  __syncwarp();  // every lane has read the buffers' last contents
  gathered_prob[position] = prob;
  gathered_id[position] = id;
  __syncwarp();
  prob = gathered_prob[lane];
  id = gathered_id[lane];
  bool valid = lane < top_k;

  // torch's bitonic network of 32 (SortUtils.cuh bitonicSort with GTOp, invalid entries last):
  // the pair A = element lo, B = element lo + stride is exchanged when "(A > B and A valid) or B
  // invalid" equals the pair's direction, (lo & size) != 0 below size 32 and false in the final
  // merge. Two equal valid probs are exchanged wherever the direction is false, so the order of
  // ties is the network's, not the index order.
#pragma unroll
  for (int size = 2; size <= 32; size *= 2) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2) {
      const float other_prob = __shfl_xor_sync(kFull, prob, stride);
      const int other_id = __shfl_xor_sync(kFull, id, stride);
      const bool other_valid = __shfl_xor_sync(kFull, static_cast<int>(valid), stride) != 0;
      const bool is_lo = (lane & stride) == 0;
      const int lo = lane & ~stride;
      const float prob_a = is_lo ? prob : other_prob, prob_b = is_lo ? other_prob : prob;
      const bool valid_a = is_lo ? valid : other_valid, valid_b = is_lo ? other_valid : valid;
      const bool a_first = ((prob_a > prob_b || (isnan(prob_a) && !isnan(prob_b))) && valid_a) || !valid_b;
      const bool descending_pair = size < 32 && (lo & size) != 0;
      if (a_first == descending_pair) {
        prob = other_prob;
        id = other_id;
        valid = other_valid;
      }
    }
  }
}

// grid: T blocks; block t routes token t. Block: one thread an expert (E <= kRankMaxExperts,
// rounded up to warps), else one warp. Shared memory: the probs [E].
template <typename T, typename W>
__global__ void __launch_bounds__(kRankMaxExperts) moe_topk_kernel(
    int64_t* __restrict__ expert_ids,  // [T, k]
    W* __restrict__ weights,           // [T, k]
    const T* __restrict__ logits,      // [T, E]
    int top_k, int num_experts, bool normalize) {
  extern __shared__ float probs[];  // [E]
  __shared__ uint64_t keys[kRankMaxExperts];
  __shared__ float picked_prob[32];
  __shared__ int picked_id[32];
  begin_dependent_kernel();
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < 32) warp_softmax(probs, logits + t * num_experts, num_experts, lane);

  float prob = 0.f;
  int id = 0;
  if (num_experts <= kRankMaxExperts) {
    // Expert e's rank: how many experts torch.topk takes before it; the first k land in order.
    __syncthreads();
    const int e = threadIdx.x;
    const uint64_t key = e < num_experts ? pick_key(probs[e], e) : 0;
    if (e < num_experts) keys[e] = key;
    __syncthreads();
    if (e < num_experts) {
      int rank = 0;
#pragma unroll 8
      for (int j = 0; j < num_experts; ++j) rank += keys[j] > key;
      if (rank < top_k) {
        picked_prob[rank] = probs[e];
        picked_id[rank] = e;
      }
    }
    __syncthreads();
    if (threadIdx.x >= 32) return;
    if (lane < top_k) {
      prob = picked_prob[lane];
      id = picked_id[lane];
    }
  } else {
    warp_argmax_rounds(probs, num_experts, top_k, lane, prob, id);
  }
  torch_tie_order(prob, id, top_k, lane, picked_prob, picked_id);

  float total = 1.f;
  if (normalize) {  // torch.sum's order
    const int width = 1 << (31 - __clz(top_k));  // the largest power of two <= k
    const float second = __shfl_down_sync(kFull, prob, width);
    float s = lane < width ? prob : 0.f;
    if (lane + width < top_k) s += second;
    for (int offset = 1; offset < width; offset <<= 1) s += __shfl_down_sync(kFull, s, offset);
    total = __shfl_sync(kFull, s, 0);
  }
  if (lane < top_k) {
    expert_ids[t * top_k + lane] = id;
    weights[t * top_k + lane] = from_float<W>(normalize ? __fdiv_rn(prob, total) : prob);
  }
}

}  // namespace

cudaError_t moe_topk(int64_t* expert_ids, void* weights, bool weights_fp32, const void* logits,
                     int64_t num_tokens, int64_t top_k, int64_t num_experts, bool normalize, DType dtype,
                     cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (num_experts > kMoeTopkMaxExperts || top_k > kMoeTopkMaxK || top_k > num_experts || top_k < 1) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = static_cast<size_t>(num_experts) * sizeof(float);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* in = static_cast<const T*>(logits);
    const int k = static_cast<int>(top_k);
    const int e = static_cast<int>(num_experts);
    const dim3 grid(static_cast<unsigned>(num_tokens));
    const int threads = e <= kRankMaxExperts ? (e + 31) / 32 * 32 : 32;
    if (weights_fp32) {
      launch_dependent(moe_topk_kernel<T, float>, grid, threads, smem, stream, expert_ids,
                       static_cast<float*>(weights), in, k, e, normalize);
    } else {
      launch_dependent(moe_topk_kernel<T, T>, grid, threads, smem, stream, expert_ids, static_cast<T*>(weights), in,
                       k, e, normalize);
    }
    return cudaGetLastError();
  });
}

}  // namespace pagedkv::kernels
