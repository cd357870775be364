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

}  // namespace pagedkv::kernels::decode
