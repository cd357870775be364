// Paged prefill attention on CUDA cores (fp32 math), for fp32 inputs (16-bit inputs take the
// tensor-core kernel, paged_prefill_attention_mma.cuh). 256 threads; a thread owns 2 rows:
// S = Q K^T for 4 keys of a tile, then O += P V for D/8 columns, P passing through shared memory.
// K/V tiles are cp.async'd as flash-attention 2 orders it: V of tile j loads while S of tile j is
// computed, K of tile j + 1 while O is updated, so one K and one V buffer suffice.
#pragma once
#include <cstring>

#include "kernels/paged_prefill_attention_common.cuh"

namespace pagedkv::kernels::prefill {

namespace simt {
constexpr int kThreads = 256;
constexpr int kRows = 64;        // (token, head) rows of a CTA: 2 a thread
constexpr int kKeys = 32;        // keys per K/V tile
constexpr int kPLd = kKeys + 8;  // P row stride (floats): 4 rows of 8 lanes hit 32 banks

template <typename T, int D>
constexpr int smem_bytes() {
  return (kRows + 2 * kKeys) * row_stride<T, D>() * static_cast<int>(sizeof(T)) +
         kRows * kPLd * static_cast<int>(sizeof(float));
}

// Two CTAs an SM (<= 128 registers a thread) where two fit in shared memory; fp32 at D = 256
// (145 KB) takes one and the registers of a whole SM half.
template <typename T, int D>
constexpr int ctas_per_sm() { return smem_bytes<T, D>() <= 80 * 1024 ? 2 : 1; }
}  // namespace simt

// Four consecutive elements of shared memory as floats (bf16 is the top half of an fp32).
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&f)[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  f[0] = __uint_as_float(w.x << 16);
  f[1] = __uint_as_float(w.x & 0xffff0000u);
  f[2] = __uint_as_float(w.y << 16);
  f[3] = __uint_as_float(w.y & 0xffff0000u);
}
__device__ __forceinline__ void load4(const __half* p, float (&f)[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  __half2 h[2];
  memcpy(h, &w, 8);
  const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}
__device__ __forceinline__ void load4(const float* p, float (&f)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  f[0] = x.x;
  f[1] = x.y;
  f[2] = x.z;
  f[3] = x.w;
}

template <typename T, int D>
__global__ void __launch_bounds__(simt::kThreads, simt::ctas_per_sm<T, D>())
paged_prefill_simt_kernel(const PagedPrefillArgs a, const Plan plan) {
  using namespace simt;
  constexpr int kLd = row_stride<T, D>();
  // 4-column groups of O per thread: columns cg * 4 + 32j; at head_dim 80 or 96 the last group
  // is partial (kPartial: a thread's columns past D are skipped).
  constexpr int kCols = (D + 31) / 32;
  constexpr bool kPartial = D % 32 != 0;
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);                       // [kRows][kLd]
  T* s_k = s_q + kRows * kLd;                                // [kKeys][kLd]
  T* s_v = s_k + kKeys * kLd;                                // [kKeys][kLd]
  float* s_p = reinterpret_cast<float*>(s_v + kKeys * kLd);  // [kRows][kPLd]

  Work w;
  if (!cta_work(a, plan, w)) return;
  const int tid = threadIdx.x;
  const int rg = tid / 8;  // row group: rows rg and rg + 32
  const int cg = tid % 8;  // keys cg + 8k of a tile; O columns cg * 4 + 32j

  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  load_q_tile<T, D, kRows, kThreads>(s_q, a, w);
  load_kv_tile<T, D, kKeys, kThreads>(s_k, k_cache, w.key_begin, a, plan, w);
  cp_async_commit();  // group: Q and K tile 0

  // Each row's last visible key (its position; -1 for rows past w.rows, which see nothing) and
  // first (the sliding window's; 0 without one).
  int limit[2], first[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = rg + 32 * i;
    limit[i] = r < w.rows ? w.pos0 + r / w.heads : -1;
    first[i] = a.sliding_window > 0 ? limit[i] - a.sliding_window + 1 : 0;
  }
  const float qk_scale = a.scale * kLog2e;
  const float cap2 = a.logit_softcap * kLog2e;  // used only when set (a uniform branch)
  float m[2] = {kNegBig, kNegBig}, l[2] = {0.f, 0.f};  // l: this thread's share of the row sum
  float acc[2][kCols * 4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int e = 0; e < kCols * 4; ++e) acc[i][e] = 0.f;
  }

  const int num_tiles = (w.kv_end - w.key_begin + kKeys - 1) / kKeys;
  for (int kt = 0; kt < num_tiles; ++kt) {
    const int key0 = w.key_begin + kt * kKeys;
    load_kv_tile<T, D, kKeys, kThreads>(s_v, v_cache, key0, a, plan, w);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K tile kt are in
    __syncthreads();

    float s[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[i][k] = 0.f;
    }
#pragma unroll 8
    for (int d = 0; d < D; d += 4) {
      float qf[2][4], kf[4][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) load4(s_q + (rg + 32 * i) * kLd + d, qf[i]);
#pragma unroll
      for (int k = 0; k < 4; ++k) load4(s_k + (cg + 8 * k) * kLd + d, kf[k]);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[i][k] = fmaf(qf[i][e], kf[k][e], s[i][k]);
        }
      }
    }

    // Causal mask and online softmax; the 8 lanes of a row group hold the row's 32 scores.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int key = key0 + cg + 8 * k;
        float x = s[i][k] * qk_scale;
        if (cap2 > 0.f) x = softcap_log2<T>(x, cap2);
        s[i][k] = key <= limit[i] && key >= first[i] ? x : -INFINITY;
        tile_max = fmaxf(tile_max, s[i][k]);
      }
      const float new_max = fmaxf(m[i], lanes_max<8>(tile_max));
      const float alpha = exp2f(m[i] - new_max);
      m[i] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float p = exp2f(s[i][k] - new_max);  // 0 for a masked key
        s_p[(rg + 32 * i) * kPLd + cg + 8 * k] = p;
        sum += p;
      }
      l[i] = l[i] * alpha + sum;
#pragma unroll
      for (int e = 0; e < kCols * 4; ++e) acc[i][e] *= alpha;
    }
    __syncthreads();  // K tile read by all, P written

    if (kt + 1 < num_tiles) load_kv_tile<T, D, kKeys, kThreads>(s_k, k_cache, key0 + kKeys, a, plan, w);
    cp_async_commit();   // possibly empty: keeps the group count uniform
    cp_async_wait<1>();  // V tile kt is in
    __syncthreads();

#pragma unroll 2
    for (int n = 0; n < kKeys; n += 4) {
      float p[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) load4(s_p + (rg + 32 * i) * kPLd + n, p[i]);
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          if (kPartial && cg * 4 + 32 * j >= D) continue;
          float vf[4];
          load4(s_v + (n + nn) * kLd + cg * 4 + 32 * j, vf);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j * 4 + e] = fmaf(p[i][nn], vf[e], acc[i][j * 4 + e]);
          }
        }
      }
    }
    __syncthreads();  // V tile and P read by all before the next tile overwrites them
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = rg + 32 * i;
    const float total = lanes_sum<8>(l[i]);
    if (r >= w.rows) continue;
    const float inv = a.sinks != nullptr ? inv_sum_with_sink(m[i], total, a.sinks[w.head0 + r % w.heads])
                                         : total > 0.f ? 1.f / total : 0.f;  // before position 0: zeros
    T* dst = output_row<T>(a, w, r);
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      if (kPartial && cg * 4 + 32 * j >= D) continue;
      Vec<T, 4> v;
#pragma unroll
      for (int e = 0; e < 4; ++e) v.v[e] = from_float<T>(acc[i][j * 4 + e] * inv);
      *reinterpret_cast<Vec<T, 4>*>(dst + cg * 4 + 32 * j) = v;
    }
  }
}

}  // namespace pagedkv::kernels::prefill
