// What paged decode attention's two main loops (CUDA cores in paged_decode_attention.cu, tensor
// cores in paged_decode_attention_mma.cuh) share.
#pragma once

namespace pagedkv::kernels::decode {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegBig = -1e30f;    // "no token yet": finite, so exp2f(kNegBig - x) is 0, not NaN
constexpr float kRescaleSlack = 8.f;  // log2 units a score may exceed the running max unrescaled

// 2^x in one MUFU instruction. exp2f wraps the same instruction in a range check that produces
// denormal results (4 instructions); a softmax weight or rescale factor under 2^-126, next to
// the max's weight of 1, is flushed to 0 instead. Used in the main loops only.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh to a few ulp of fp32: the build's --use_fast_math turns tanhf into tanh.approx.f32
// (relative error ~2^-11: 0.02 on a score capped at 50); expm1f keeps small x exact. Past
// |x| = 9, tanh is 1 in fp32 (and expm1f would overflow).
__device__ __forceinline__ float precise_tanh(float x) {
  const float e = expm1f(2.f * fminf(fabsf(x), 9.f));
  return copysignf(e / (e + 2.f), x);
}

// cap2 * tanh(s / cap2) in fp64, rounded once. Not inlined: its fp64 registers stay out of the
// main loops' allocation (a call only on the softcapped path). Static: one copy per file.
static __device__ __noinline__ float softcap_log2_fp64(float s, float cap2) {
  return static_cast<float>(cap2 * tanh(static_cast<double>(s) / cap2));
}

// Gemma-2's logit softcap on a score in log2 units: the natural score s / log2(e) becomes
// cap * tanh(s / log2(e) / cap), i.e. in log2 units cap2 * tanh(s / cap2) with cap2 = cap *
// log2(e). Applied only when the cap is set (a uniform branch around the call). fp32 inputs get
// it in fp64 (rounded once, as PyTorch's fp32 tanh: a few ulp times a cap of 50 would pass the
// fp32 tests' error); 16-bit ones in fp32 (far below their rounding). Shared with the prefill
// kernels.
template <typename T>
__device__ __forceinline__ float softcap_log2(float s, float cap2) {
  if constexpr (sizeof(T) == 4) {
    return softcap_log2_fp64(s, cap2);
  } else {
    return cap2 * precise_tanh(s / cap2);
  }
}

// The first key a sequence of `ctx` tokens attends to under a sliding window (0: none): a query
// at position ctx - 1 sees keys j with ctx - 1 - j < window.
__device__ __forceinline__ int window_first_key(int ctx, int window) {
  return window > 0 ? max(0, ctx - window) : 0;
}

}  // namespace pagedkv::kernels::decode
