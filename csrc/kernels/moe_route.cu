// The fused router kernel: one block per token. Its warps compute the E logits (one warp per
// expert, 16-byte loads, several in flight per lane: a block alone reads the whole router), then
// the block takes the fp32 softmax, and warp 0 picks the top k by k rounds of a warp argmax
// (E <= 4096, k small: cheaper than a sort). --use_fast_math is on for the kernels, so the exp
// runs in double and the divisions are __fdiv_rn: torch's own softmax/normalise are IEEE fp32.
#include <cmath>
#include <climits>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/moe_route.h"

namespace pagedkv::kernels {
namespace {

constexpr int kThreads = 1024;  // one block reads all E x D router weights: many loads in flight
constexpr int kWarps = kThreads / 32;

// a . b over n elements (kVec-element vectors), summed over the warp: every lane gets it.
template <typename T, int kVec>
__device__ __forceinline__ float warp_dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  using V = Vec<T, kVec>;
  const V* va = reinterpret_cast<const V*>(a);
  const V* vb = reinterpret_cast<const V*>(b);
  float sum = 0.f;
#pragma unroll 4
  for (int64_t i = threadIdx.x % 32; i < n / kVec; i += 32) {
    const V x = va[i];
    const V y = vb[i];
#pragma unroll
    for (int j = 0; j < kVec; ++j) sum = fmaf(to_float(x.v[j]), to_float(y.v[j]), sum);
  }
  return warp_sum(sum);
}

// Max over the block; every thread gets it.
__device__ __forceinline__ float block_max(float x) {
  __shared__ float warp_partials[32];
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  if (lane == 0) warp_partials[threadIdx.x / 32] = x;
  __syncthreads();
  x = lane < static_cast<int>(blockDim.x / 32) ? warp_partials[lane] : -INFINITY;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  __syncthreads();
  return x;
}

// Whether (a, expert ia) ranks before (b, expert ib) in the top k: NaN first (torch.topk counts
// NaN as the largest), then the larger value, then, between equal values, the lower expert.
// A strict total order, so every lane of a warp reduction agrees on the winner.
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
  const bool a_nan = isnan(a), b_nan = isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// grid: T blocks; block t routes token t. Shared memory: probs [E], then the top-k values [k].
template <typename T, typename W, int kVec>
__global__ void __launch_bounds__(kThreads) moe_route_kernel(
    int64_t* __restrict__ expert_ids,  // [T, k]
    W* __restrict__ weights,           // [T, k]
    const T* __restrict__ x,           // [T, D]
    const T* __restrict__ router,      // [E, D]
    int top_k, int num_experts, int64_t hidden, bool normalize) {
  extern __shared__ float shared[];
  float* probs = shared;               // [E]: the logits, then the probs (-1: taken)
  float* top = shared + num_experts;   // [k]
  begin_dependent_kernel();
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int e = warp; e < num_experts; e += kWarps) {
    const float logit = warp_dot<T, kVec>(x + t * hidden, router + e * hidden, hidden);
    if (lane == 0) probs[e] = to_float(from_float<T>(logit));  // HF: logits in the model dtype
  }
  __syncthreads();
  float max_logit = -INFINITY;
  for (int e = threadIdx.x; e < num_experts; e += kThreads) max_logit = fmaxf(max_logit, probs[e]);
  max_logit = block_max(max_logit);
  float sum = 0.f;
  for (int e = threadIdx.x; e < num_experts; e += kThreads) {
    const float p = static_cast<float>(exp(static_cast<double>(probs[e] - max_logit)));
    probs[e] = p;
    sum += p;
  }
  sum = block_sum(sum);  // its barriers also publish the exps above
  for (int e = threadIdx.x; e < num_experts; e += kThreads) probs[e] = __fdiv_rn(probs[e], sum);
  __syncthreads();
  if (warp != 0) return;
  // Warp 0: k rounds of argmax. Expert e belongs to lane e % 32, which alone reads and marks it.
  for (int j = 0; j < top_k; ++j) {
    float best = -2.f;  // below every prob and below a taken expert's -1
    int best_e = INT_MAX;
    for (int e = lane; e < num_experts; e += 32) {
      if (ranks_before(probs[e], e, best, best_e)) {
        best = probs[e];
        best_e = e;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, offset);
      if (ranks_before(other, other_e, best, best_e)) {
        best = other;
        best_e = other_e;
      }
    }
    if (lane == best_e % 32) probs[best_e] = -1.f;
    if (lane == 0) {
      top[j] = best;
      expert_ids[t * top_k + j] = best_e;
    }
  }
  if (lane != 0) return;
  float top_sum = 0.f;
  for (int j = 0; normalize && j < top_k; ++j) top_sum = __fadd_rn(top_sum, top[j]);
  for (int j = 0; j < top_k; ++j) {
    weights[t * top_k + j] = from_float<W>(normalize ? __fdiv_rn(top[j], top_sum) : top[j]);
  }
}

}  // namespace

cudaError_t moe_route(int64_t* expert_ids, void* weights, bool weights_fp32, const void* x,
                      const void* router, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                      int64_t hidden, bool normalize, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (num_experts > kMoeRouteMaxExperts || top_k > num_experts) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(num_experts + top_k) * sizeof(float);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = hidden % kVec == 0 && aligned16(x) && aligned16(router);
    auto* in = static_cast<const T*>(x);
    auto* r = static_cast<const T*>(router);
    const int k = static_cast<int>(top_k);
    const int e = static_cast<int>(num_experts);
    const dim3 grid(static_cast<unsigned>(num_tokens));
    auto run = [&](auto weight_tag) {
      using W = decltype(weight_tag);
      auto* w = static_cast<W*>(weights);
      if (vectorized) {
        return launch_dependent(moe_route_kernel<T, W, kVec>, grid, kThreads, smem, stream, expert_ids, w, in,
                                r, k, e, hidden, normalize);
      }
      return launch_dependent(moe_route_kernel<T, W, 1>, grid, kThreads, smem, stream, expert_ids, w, in, r, k,
                              e, hidden, normalize);
    };
    if (weights_fp32) {
      run(float{});
    } else {
      run(T{});
    }
    return cudaGetLastError();
  });
}

}  // namespace pagedkv::kernels
