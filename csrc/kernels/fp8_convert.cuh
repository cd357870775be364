// e4m3 -> bf16 / fp16 in registers, exact, four values at a time: the fp8 KV cache's attention
// loop (paged_decode_attention_mma.cuh) converts every K/V element it reads, so the conversion
// must cost a few integer ops, not the quarter-rate cvt chain (e4m3 -> f16x2 -> f32 -> bf16x2).
//
// An e4m3 byte s eeee mmm placed as a 16-bit float s 000 eeee mmm 0000 (bf16) or s 0 eeee mmm
// 0000000 (fp16) keeps its exponent field, which the wider format reads with its own bias: the
// value comes out as the e4m3 value times 2^-120 (bf16: bias 127 vs 7) or 2^-8 (fp16: bias 15
// vs 7), for normal and subnormal e4m3 alike (both formats' subnormals share the 0.mmm form). One
// multiply by the power of two back, exact, gives the value. e4m3's NaN bytes (0x7F, 0xFF) come
// out as +-480: pagedkv's cache writes saturate to +-448 and never store them.
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace pagedkv::kernels {

// Two e4m3 values (the low byte first) -> two floats, exactly (NaN bytes stay NaN): e4m3 is a
// subset of fp16, one cvt a pair on Hopper.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
  return __half22float2(__half2(h));
}

// Bytes b0..b3 of `word` (b0 the lowest) -> {(b0, b1), (b2, b3)} as pairs of T, the lower byte in
// the lower half; kStrided: {(b0, b2), (b1, b3)} (a word that holds two rows' byte pairs).
template <typename T, bool kStrided = false>
__device__ __forceinline__ uint2 e4m3x4_to(uint32_t word) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int kShift = kBf16 ? 4 : 1;  // 3 + 1 exponent bits the format has beyond e4m3's
  // 2^120 (bf16 0x7B80) or 2^8 (fp16 0x5C00), in both halves
  constexpr uint32_t kScale2 = kBf16 ? 0x7B807B80u : 0x5C005C00u;
  // [b1 0 b0 0], [b3 0 b2 0] (kStrided: [b2 0 b0 0], [b3 0 b1 0])
  uint32_t pairs[2] = {__byte_perm(word, 0, kStrided ? 0x2404 : 0x1404),
                       __byte_perm(word, 0, kStrided ? 0x3414 : 0x3424)};
  uint2 out;
  uint32_t* dst = &out.x;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t placed = (pairs[i] & 0x80008000u) | ((pairs[i] & 0x7F007F00u) >> kShift);
    if constexpr (kBf16) {
      __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&placed),
                                 *reinterpret_cast<const __nv_bfloat162*>(&kScale2));
      dst[i] = *reinterpret_cast<uint32_t*>(&v);
    } else {
      __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&placed), *reinterpret_cast<const __half2*>(&kScale2));
      dst[i] = *reinterpret_cast<uint32_t*>(&v);
    }
  }
  return out;
}

}  // namespace pagedkv::kernels
