// Two 16-bit floats (bf16 or fp16) in one 32-bit register, and the int4 dequantization that builds
// them with no conversion instruction (the cvt path, int -> fp32 -> T, runs at a quarter of the
// FMA rate on Hopper and bounds a 4-bit kernel's issue before its memory does):
//   lop3(word >> 4s, 0x000F000F, M M) = (M + q_lo, M + q_hi)   M = 128 (bf16) or 1024 (fp16):
//                                      the float with M's exponent and q in the low mantissa bits
//   sub2(., (M + z, M + z))           = (q_lo - z, q_hi - z)    exact: small integers
//   mul2(., (s, s))                   = the dequantized pair    rounded once to T, as
//                                                               PyTorch's (q - z) * s in T is
// (the product of two 16-bit floats is exact in fp32, so the one rounding is fp32's then T's).
// Used by the 4-bit tensor-core GEMV (gemv_4bit_mma.cu) and the int4 MoE experts
// (moe_expert_rows.cuh).
#pragma once
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pagedkv::kernels {

template <typename T>
struct Magic;  // the 16-bit float M whose mantissa's low bits take an int4 value exactly
template <>
struct Magic<__nv_bfloat16> {
  static constexpr uint32_t kBits = 0x4300;  // 128: ulp 1 on [128, 256), so M + z exact for z < 128
  static constexpr float kValue = 128.f;
};
template <>
struct Magic<__half> {
  static constexpr uint32_t kBits = 0x6400;  // 1024: ulp 1 on [1024, 2048)
  static constexpr float kValue = 1024.f;
};

template <typename T>
using Pair2 = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat162, __half2>;

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d;  // (a & mask) | bits in one instruction
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
  return d;
}

template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
  Pair2<T> r = __hsub2(*reinterpret_cast<const Pair2<T>*>(&a), *reinterpret_cast<const Pair2<T>*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

template <typename T>
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
  Pair2<T> r = __hmul2(*reinterpret_cast<const Pair2<T>*>(&a), *reinterpret_cast<const Pair2<T>*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

template <typename T>
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  Pair2<T> r = __hfma2(*reinterpret_cast<const Pair2<T>*>(&a), *reinterpret_cast<const Pair2<T>*>(&b),
                       *reinterpret_cast<const Pair2<T>*>(&c));
  return *reinterpret_cast<uint32_t*>(&r);
}

// v in both halves.
template <typename T>
__device__ __forceinline__ uint32_t broadcast2(T v) {
  const uint32_t bits = *reinterpret_cast<const uint16_t*>(&v);
  return bits | (bits << 16);
}

// (M + z, M + z) for an int4 zero point z (< 128: M + z stays in M's binade), from its bits.
template <typename T>
__device__ __forceinline__ uint32_t magic_zero2(uint32_t z) {
  return (Magic<T>::kBits + z) * 0x00010001u;
}

// nibbles s and s + 4 of `word` (s = 0..3) dequantized as (q - z) * s in T: the low and the high half.
template <typename T>
__device__ __forceinline__ uint32_t int4_pair(uint32_t word, int s, uint32_t zero2, uint32_t scale2) {
  constexpr uint32_t kMagic2 = Magic<T>::kBits * 0x00010001u;
  return mul2<T>(sub2<T>(lop3_and_or(word >> (4 * s), 0x000F000Fu, kMagic2), zero2), scale2);
}

// The low (kHigh false) or high half of a pair as T.
template <typename T, bool kHigh>
__device__ __forceinline__ T half_of(uint32_t pair) {
  const uint16_t bits = static_cast<uint16_t>(kHigh ? pair >> 16 : pair);
  return *reinterpret_cast<const T*>(&bits);
}

// (a, b) rounded to T, the low half a: one packing conversion for two values.
template <typename T>
__device__ __forceinline__ uint32_t round_pair(float a, float b) {
  Pair2<T> r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    r = __floats2bfloat162_rn(a, b);
  } else {
    r = __floats2half2_rn(a, b);
  }
  return *reinterpret_cast<uint32_t*>(&r);
}

}  // namespace pagedkv::kernels
