// The mixture-of-experts decode kernels: GEMV-style, one warp per output row, reading only the
// rows of the experts each token chose. Simple on purpose: every (token, expert) pair reads its
// expert's rows itself (pairs of one expert share them through L2).
#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/moe_experts.h"
#include "kernels/silu.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kWarps = 8;  // output rows per block
constexpr int kThreads = kWarps * 32;

// a . b over n elements (kVec-element vectors), summed over the warp: every lane gets it.
template <typename T, int kVec>
__device__ __forceinline__ float warp_dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  using V = Vec<T, kVec>;
  const V* va = reinterpret_cast<const V*>(a);
  const V* vb = reinterpret_cast<const V*>(b);
  float sum = 0.f;
  for (int64_t i = threadIdx.x % 32; i < n / kVec; i += 32) {
    const V x = va[i];
    const V y = vb[i];
#pragma unroll
    for (int j = 0; j < kVec; ++j) sum = fmaf(to_float(x.v[j]), to_float(y.v[j]), sum);
  }
  return warp_sum(sum);
}

// grid: (T * k pairs, ceil(I / kWarps)); warp w of block (p, b) computes out[p, b * kWarps + w].
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) moe_gate_up_silu_kernel(
    T* __restrict__ out,                 // [T, k, I]
    const T* __restrict__ x,             // [T, D]
    const T* __restrict__ gate_up,       // [E, 2I, D]
    const int64_t* __restrict__ ids,     // [T, k]
    int64_t top_k, int64_t num_experts, int64_t hidden, int64_t intermediate) {
  begin_dependent_kernel();
  const int64_t pair = blockIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  if (row >= intermediate) return;
  const int64_t e = ids[pair];
  T result = from_float<T>(0.f);
  if (e >= 0 && e < num_experts) {
    const T* token = x + (pair / top_k) * hidden;
    const T* gate = gate_up + (e * 2 * intermediate + row) * hidden;
    const T g = from_float<T>(warp_dot<T, kVec>(token, gate, hidden));
    const T u = from_float<T>(warp_dot<T, kVec>(token, gate + intermediate * hidden, hidden));
    result = silu_mul(g, u);
  }
  if (threadIdx.x % 32 == 0) out[pair * intermediate + row] = result;
}

// grid: (T, ceil(D / kWarps)); warp w of block (t, b) computes out[t, b * kWarps + w], summing
// the token's k experts in order.
template <typename T, typename W, int kVec>
__global__ void __launch_bounds__(kThreads) moe_down_sum_kernel(
    T* __restrict__ out,                 // [T, D]
    const T* __restrict__ act,           // [T, k, I]
    const T* __restrict__ down,          // [E, D, I]
    const int64_t* __restrict__ ids,     // [T, k]
    const W* __restrict__ weights,       // [T, k]
    int64_t top_k, int64_t num_experts, int64_t hidden, int64_t intermediate) {
  begin_dependent_kernel();
  const int64_t t = blockIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  if (row >= hidden) return;
  float sum = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t e = ids[t * top_k + j];
    if (e < 0 || e >= num_experts) continue;
    const float y = to_float(from_float<T>(
        warp_dot<T, kVec>(act + (t * top_k + j) * intermediate, down + (e * hidden + row) * intermediate,
                          intermediate)));
    // HF: expert output (dtype) * weight, in the weights' dtype; then an fp32 sum. No FMA.
    const float weighted = to_float(from_float<W>(__fmul_rn(y, to_float(weights[t * top_k + j]))));
    sum = __fadd_rn(sum, weighted);
  }
  if (threadIdx.x % 32 == 0) out[t * hidden + row] = from_float<T>(sum);
}

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kWarps - 1) / kWarps); }

}  // namespace

cudaError_t moe_gate_up_silu(void* out, const void* x, const void* gate_up, const int64_t* expert_ids,
                             int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                             int64_t intermediate, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0 || intermediate == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const dim3 grid(static_cast<unsigned>(num_tokens * top_k), blocks_for(intermediate));
    auto* o = static_cast<T*>(out);
    auto* in = static_cast<const T*>(x);
    auto* w = static_cast<const T*>(gate_up);
    if (hidden % kVec == 0 && aligned16(x) && aligned16(gate_up)) {
      launch_dependent(moe_gate_up_silu_kernel<T, kVec>, grid, kThreads, 0, stream, o, in, w, expert_ids,
                       top_k, num_experts, hidden, intermediate);
    } else {
      launch_dependent(moe_gate_up_silu_kernel<T, 1>, grid, kThreads, 0, stream, o, in, w, expert_ids,
                       top_k, num_experts, hidden, intermediate);
    }
    return cudaGetLastError();
  });
}

cudaError_t moe_down_sum(void* out, const void* act, const void* down, const int64_t* expert_ids,
                         const void* weights, bool weights_fp32, int64_t num_tokens, int64_t top_k,
                         int64_t num_experts, int64_t hidden, int64_t intermediate, DType dtype,
                         cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const dim3 grid(static_cast<unsigned>(num_tokens), blocks_for(hidden));
    auto* o = static_cast<T*>(out);
    auto* a = static_cast<const T*>(act);
    auto* d = static_cast<const T*>(down);
    const bool vectorized = intermediate % kVec == 0 && aligned16(act) && aligned16(down);
    auto run = [&](auto weight_tag) {
      using W = decltype(weight_tag);
      auto* w = static_cast<const W*>(weights);
      if (vectorized) {
        return launch_dependent(moe_down_sum_kernel<T, W, kVec>, grid, kThreads, 0, stream, o, a, d,
                                expert_ids, w, top_k, num_experts, hidden, intermediate);
      }
      return launch_dependent(moe_down_sum_kernel<T, W, 1>, grid, kThreads, 0, stream, o, a, d, expert_ids,
                              w, top_k, num_experts, hidden, intermediate);
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
