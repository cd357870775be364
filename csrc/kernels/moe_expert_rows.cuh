// How the mixture-of-experts kernels (moe_experts.cu) read an expert projection's rows: kVec
// values at a time, handed over in the model's dtype T whatever the format stores, so the kernels'
// fp32 products are the same code for every format. A quantized format dequantizes each value as
// layers/moe_quantized.py's dequantize_experts does (one fp32 product rounded to T), so its kernels
// give, bit for bit, the dense kernels' results on the dequantized weights.
//
// In 16-bit dtypes the formats dequantize in few instructions a value: int4 with scales in T by
// half_pairs.cuh's int4_pair (no conversion), the rest through fp32 rounded to T two values at a
// time (one packing cvt a pair, not one a value). A load's group or scale block comes from a
// multiply-shift (FastDivisor), not an integer division, and the scales' dtype is a template
// argument, so no branch sits between a warp's unrolled loads. (Session 38's H100 profile at
// batch 1: the int4 down kernel 17% faster without the per-value conversions.)
//
// A format provides:
//   Row row(e, r)                  row r of expert e
//   Vec<T, kVec> load<kStreaming>(row, i)   the row's i-th kVec values (kStreaming: read once,
//                                  through the non-coherent path without allocating in L1)
//   row.values, row_bytes(cols)    where a row's stored bytes start, and how many (L2 prefetches)
#pragma once
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/fp8_convert.cuh"
#include "kernels/half_pairs.cuh"

namespace pagedkv::kernels {

// 16, 8, 4 or 2 bytes of expert weight, read once: through the non-coherent path and without
// allocating in L1, which is left to what the warps share (as gemv.cu's load_streaming).
template <typename V>
__device__ __forceinline__ V load_streaming(const V* p) {
  V v;
  if constexpr (sizeof(V) == 16) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    *reinterpret_cast<uint4*>(&v) = r;
  } else if constexpr (sizeof(V) == 8) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    *reinterpret_cast<uint2*>(&v) = r;
  } else if constexpr (sizeof(V) == 4) {
    uint32_t r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    *reinterpret_cast<uint32_t*>(&v) = r;
  } else {
    static_assert(sizeof(V) == 2, "16-, 8-, 4- or 2-byte vectors only");
    uint16_t r;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
    *reinterpret_cast<uint16_t*>(&v) = r;
  }
  return v;
}

// One vector of stored values: streamed (read once) or through L1.
template <bool kStreaming, typename B>
__device__ __forceinline__ B load_stored(const B* p) {
  if constexpr (kStreaming) {
    return load_streaming(p);
  } else {
    return *p;
  }
}

// n / d for 0 <= n < 2^31 by a multiply-high, an add and a shift (d >= 1 fixed at launch): the
// round-up reciprocal m = 2^32 (2^s - d) / d + 1, s = ceil(log2 d) (Granlund and Montgomery).
struct FastDivisor {
  uint32_t mul;
  uint32_t shift;

  FastDivisor() = default;
  explicit FastDivisor(uint32_t d) {
    shift = 0;
    while ((1ull << shift) < d) ++shift;
    mul = static_cast<uint32_t>(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t divide(uint32_t n) const { return (__umulhi(n, mul) + n) >> shift; }
};

// kVec fp32 values rounded to T, two at a time in 16-bit dtypes.
template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> rounded(const float (&w)[kVec]) {
  Vec<T, kVec> out;
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = w[j];
  } else {
    uint32_t* pairs = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) pairs[j] = round_pair<T>(w[2 * j], w[2 * j + 1]);
  }
  return out;
}

// The weights as stored in T: [E, R, C] contiguous.
template <typename T, int kVec>
struct DenseRows {
  using V = Vec<T, kVec>;
  static constexpr int64_t row_bytes(int64_t cols) { return cols * static_cast<int64_t>(sizeof(T)); }
  const T* weight;  // [E, R, C]
  int64_t rows;     // R
  int64_t cols;     // C

  struct Row {
    const V* values;
  };

  __device__ __forceinline__ Row row(int64_t e, int64_t r) const {
    return {reinterpret_cast<const V*>(weight + (e * rows + r) * cols)};
  }
  template <bool kStreaming>
  __device__ __forceinline__ V load(const Row& row, int64_t i) const {
    return load_stored<kStreaming>(&row.values[i]);
  }
};

// FP8 (FineGrainedFP8, compressed-tensors): W[e, r, c] = T(float(q[e, r, c]) * scales[e, r / block_n,
// c / block_k]), q e4m3. block_k % kVec == 0, so the kVec values of a load share one scale.
template <typename T, int kVec>
struct Fp8Rows {
  using V = Vec<T, kVec>;
  static_assert(kVec == 8 || kVec == 4, "8 or 4 e4m3 values a load");
  static constexpr int64_t row_bytes(int64_t cols) { return cols; }
  using Bytes = std::conditional_t<kVec == 8, uint2, uint32_t>;  // kVec e4m3 values
  const uint8_t* weight;  // [E, R, C] e4m3
  const float* scales;    // [E, ceil(R / block_n), ceil(C / block_k)]
  int64_t rows;           // R
  int64_t cols;           // C
  int block_n;
  int block_k;
  FastDivisor loads_a_block;  // block_k / kVec

  struct Row {
    const Bytes* values;
    const float* scales;  // this row's block row
  };

  __device__ __forceinline__ Row row(int64_t e, int64_t r) const {
    const int64_t scale_rows = (rows + block_n - 1) / block_n;
    const int64_t scale_cols = (cols + block_k - 1) / block_k;
    return {reinterpret_cast<const Bytes*>(weight + (e * rows + r) * cols),
            scales + (e * scale_rows + r / block_n) * scale_cols};
  }
  template <bool kStreaming>
  __device__ __forceinline__ V load(const Row& row, int64_t i) const {
    const Bytes stored = load_stored<kStreaming>(&row.values[i]);
    const float scale = __ldg(row.scales + loads_a_block.divide(static_cast<uint32_t>(i)));
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&stored);
    float w[kVec];
#pragma unroll
    for (int j = 0; j < kVec / 4; ++j) {  // e4m3 pairs -> fp16 pairs (one cvt a pair) -> fp32
      const float2 lo = e4m3x2_to_float2(words[j]);
      const float2 hi = e4m3x2_to_float2(words[j] >> 16);
      w[4 * j] = __fmul_rn(lo.x, scale);
      w[4 * j + 1] = __fmul_rn(lo.y, scale);
      w[4 * j + 2] = __fmul_rn(hi.x, scale);
      w[4 * j + 3] = __fmul_rn(hi.y, scale);
    }
    return rounded<T, kVec>(w);
  }
};

// Int4 weight-only (AWQ, GPTQ without desc_act, compressed-tensors W4A16), as layers/moe_quantized.py's
// Int4Experts: W[e, r, c] = T(float(q - zeros[e, r, c / g]) * float(scales[e, r, c / g])), q the
// low (even c) or high (odd c) nibble of packed[e, r, c / 2]. g % kVec == 0, so the kVec values
// of a load share one group; the scales S as the checkpoint stores them (bf16, fp16 or fp32);
// zeros < 128 (int4 zero points, GPTQ's stored + 1 included).
template <typename T, int kVec, typename S>
struct Int4Rows {
  using V = Vec<T, kVec>;
  static_assert(kVec == 8 || kVec == 4, "8 or 4 int4 values a load");
  static constexpr int64_t row_bytes(int64_t cols) { return cols / 2; }
  using Bytes = std::conditional_t<kVec == 8, uint32_t, uint16_t>;  // kVec values, two a byte
  const uint8_t* packed;  // [E, R, C / 2]
  const S* scales;        // [E, R, C / g]
  const uint8_t* zeros;   // [E, R, C / g]
  int64_t rows;           // R
  int64_t cols;           // C
  int group_size;         // g
  FastDivisor loads_a_group;  // g / kVec

  // Kept small: the down kernels hold kDownGroup of them in registers.
  struct Row {
    const Bytes* values;
    int64_t groups;  // the row's first group: e * R * (C / g) + r * (C / g)
  };

  __device__ __forceinline__ Row row(int64_t e, int64_t r) const {
    return {reinterpret_cast<const Bytes*>(packed + (e * rows + r) * (cols / 2)), (e * rows + r) * (cols / group_size)};
  }
  template <bool kStreaming>
  __device__ __forceinline__ V load(const Row& row, int64_t i) const {
    const Bytes stored = load_stored<kStreaming>(&row.values[i]);
    const int64_t group = row.groups + loads_a_group.divide(static_cast<uint32_t>(i));
    const uint32_t zero = zeros[group];
    if constexpr (kVec == 8 && std::is_same_v<S, T>) {  // the packed pairs: no conversion
      const uint32_t zero2 = magic_zero2<T>(zero);
      const uint32_t scale2 = broadcast2<T>(scales[group]);
      V out;
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // nibbles s and s + 4: values s and s + 4
        const uint32_t pair = int4_pair<T>(stored, s, zero2, scale2);
        out.v[s] = half_of<T, false>(pair);
        out.v[s + 4] = half_of<T, true>(pair);
      }
      return out;
    } else {
      const float scale = to_float(scales[group]);
      float w[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int q = (static_cast<uint32_t>(stored) >> (4 * j)) & 0xF;
        w[j] = __fmul_rn(static_cast<float>(q - static_cast<int>(zero)), scale);
      }
      return rounded<T, kVec>(w);
    }
  }
};

}  // namespace pagedkv::kernels
