// How the mixture-of-experts kernels (moe_experts.cu) read an expert projection's rows: kVec
// values at a time, handed over in the model's dtype T whatever the format stores, so the kernels'
// fp32 products are the same code for every format. A quantized format dequantizes each value as
// layers/moe_quantized.py's dequantize_experts does (one fp32 product rounded to T), so its kernels
// give, bit for bit, the dense kernels' results on the dequantized weights.
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

  struct Row {
    const Bytes* values;
    const float* scales;     // this row's block row
    unsigned loads_a_block;  // block_k / kVec
  };

  __device__ __forceinline__ Row row(int64_t e, int64_t r) const {
    const int64_t scale_rows = (rows + block_n - 1) / block_n;
    const int64_t scale_cols = (cols + block_k - 1) / block_k;
    return {reinterpret_cast<const Bytes*>(weight + (e * rows + r) * cols),
            scales + (e * scale_rows + r / block_n) * scale_cols, static_cast<unsigned>(block_k / kVec)};
  }
  template <bool kStreaming>
  __device__ __forceinline__ V load(const Row& row, int64_t i) const {
    const Bytes stored = load_stored<kStreaming>(&row.values[i]);
    const float scale = __ldg(row.scales + static_cast<unsigned>(i) / row.loads_a_block);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&stored);
    V out;
#pragma unroll
    for (int j = 0; j < kVec / 4; ++j) {
      const float2 lo = e4m3x2_to_float2(words[j]);
      const float2 hi = e4m3x2_to_float2(words[j] >> 16);
      out.v[4 * j] = from_float<T>(__fmul_rn(lo.x, scale));
      out.v[4 * j + 1] = from_float<T>(__fmul_rn(lo.y, scale));
      out.v[4 * j + 2] = from_float<T>(__fmul_rn(hi.x, scale));
      out.v[4 * j + 3] = from_float<T>(__fmul_rn(hi.y, scale));
    }
    return out;
  }
};

// Int4 weight-only (AWQ, GPTQ without desc_act, compressed-tensors W4A16), as layers/moe_quantized.py's
// Int4Experts: W[e, r, c] = T(float(q - zeros[e, r, c / g]) * float(scales[e, r, c / g])), q the
// low (even c) or high (odd c) nibble of packed[e, r, c / 2]. g % kVec == 0, so the kVec values
// of a load share one group; the scales in their checkpoint's dtype (scale_dtype, read as stored).
template <typename T, int kVec>
struct Int4Rows {
  using V = Vec<T, kVec>;
  static_assert(kVec == 8 || kVec == 4, "8 or 4 int4 values a load");
  static constexpr int64_t row_bytes(int64_t cols) { return cols / 2; }
  using Bytes = std::conditional_t<kVec == 8, uint32_t, uint16_t>;  // kVec values, two a byte
  const uint8_t* packed;  // [E, R, C / 2]
  const void* scales;     // [E, R, C / g] of scale_dtype
  const uint8_t* zeros;   // [E, R, C / g]
  int64_t rows;           // R
  int64_t cols;           // C
  int group_size;         // g
  DType scale_dtype;

  // Kept small: the down kernels hold kDownGroup of them in registers.
  struct Row {
    const Bytes* values;
    int64_t groups;  // the row's first group: e * R * (C / g) + r * (C / g)
  };

  __device__ __forceinline__ Row row(int64_t e, int64_t r) const {
    return {reinterpret_cast<const Bytes*>(packed + (e * rows + r) * (cols / 2)), (e * rows + r) * (cols / group_size)};
  }
  __device__ __forceinline__ float scale_at(int64_t group) const {
    if (scale_dtype == DType::kBFloat16) return to_float(static_cast<const __nv_bfloat16*>(scales)[group]);
    if (scale_dtype == DType::kFloat16) return to_float(static_cast<const __half*>(scales)[group]);
    return static_cast<const float*>(scales)[group];
  }
  template <bool kStreaming>
  __device__ __forceinline__ V load(const Row& row, int64_t i) const {
    const Bytes stored = load_stored<kStreaming>(&row.values[i]);
    const int64_t group = row.groups + static_cast<unsigned>(i) / static_cast<unsigned>(group_size / kVec);
    const float scale = scale_at(group);
    const int zero = zeros[group];
    V out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int q = (static_cast<uint32_t>(stored) >> (4 * j)) & 0xF;
      out.v[j] = from_float<T>(__fmul_rn(static_cast<float>(q - zero), scale));
    }
    return out;
  }
};

}  // namespace pagedkv::kernels
