// Paged prefill attention on tensor cores (mma.sync m16n8k16, bf16/fp16 in, fp32 accumulate;
// sm_80 and later). 4 warps, each owning 16 of the CTA's 64 rows, flash-attention 2 style:
//   S = Q K^T: Q and K fragments by ldmatrix from shared memory;
//   causal mask + online softmax on the S accumulators (a row's keys sit in the 4 lanes of a quad);
//   O += P V: the S accumulators, rounded to bf16/fp16, are P's A fragments as they are (no
//   shared-memory round trip); V fragments by ldmatrix.trans.
// K/V tiles are cp.async'd as in the CUDA-core kernel: V of tile j while S of tile j is computed,
// K of tile j + 1 while O is updated.
// (Fragment layouts: kernels/mma.cuh.)
#pragma once
#include "kernels/paged_prefill_common.cuh"

namespace pagedkv::kernels::prefill {

namespace mma {
constexpr int kWarps = kRows / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 32;  // keys per K/V tile

template <typename T, int D>
constexpr int smem_bytes() {
  return (kRows + 2 * kKeys) * row_stride<T, D>() * static_cast<int>(sizeof(T));
}

// CTAs an SM the registers allow (65536 / (128 x 4, 3, 2): 128, 170, 255 a thread); a lane holds
// D / 2 O accumulators, and D = 128 spills at 128 registers.
template <int D>
constexpr int ctas_per_sm() { return D == 64 ? 4 : D == 128 ? 3 : 2; }
}  // namespace mma

template <typename T, int D>
__global__ void __launch_bounds__(mma::kThreads, mma::ctas_per_sm<D>()) paged_prefill_mma_kernel(const PagedPrefillArgs a,
                                                                          const Plan plan) {
  using namespace mma;
  constexpr int kLd = row_stride<T, D>();
  constexpr int kKeyTiles = kKeys / 8;  // n-tiles of S
  constexpr int kDimTiles = D / 8;      // n-tiles of O
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);  // [kRows][kLd]
  T* s_k = s_q + kRows * kLd;           // [kKeys][kLd]
  T* s_v = s_k + kKeys * kLd;           // [kKeys][kLd]

  Work w;
  if (!cta_work(a, plan, w)) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;

  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  load_q_tile<T, D, kThreads>(s_q, a, w);
  load_kv_tile<T, D, kKeys, kThreads>(s_k, k_cache, 0, a, plan, w);
  cp_async_commit();  // group: Q and K tile 0

  // This lane's rows: warp * 16 + g + 8i. Their last visible key (position); -1 past w.rows.
  int limit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i;
    limit[i] = r < w.rows ? w.pos0 + r / w.heads : -1;
  }
  // ldmatrix row addresses. A (Q): lanes 0-7 rows 0-7, 8-15 rows 8-15, 16-31 again at column +8.
  // B (K, keys as n): lanes 0-7 keys 0-7 at d, 8-15 the same keys at d + 8, 16-31 keys 8-15.
  // B (V, keys as k, transposed): lanes 0-7 keys 0-7, 8-15 keys 8-15, 16-31 again at d + 8.
  const T* q_frag = s_q + (warp * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * kLd + 8 * (lane / 16);
  const T* k_frag = s_k + (lane % 8 + 8 * (lane / 16)) * kLd + 8 * ((lane / 8) % 2);
  const T* v_frag = s_v + (lane % 8 + 8 * ((lane / 8) % 2)) * kLd + 8 * (lane / 16);

  const float qk_scale = a.scale * kLog2e;
  float m[2] = {kNegBig, kNegBig}, l[2] = {0.f, 0.f};  // l: this lane's share of the row sum
  float o[kDimTiles][4];
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  }

  const int num_tiles = (w.kv_end + kKeys - 1) / kKeys;
  for (int kt = 0; kt < num_tiles; ++kt) {
    const int key0 = kt * kKeys;
    load_kv_tile<T, D, kKeys, kThreads>(s_v, v_cache, key0, a, plan, w);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K tile kt are in
    __syncthreads();

    float s[kKeyTiles][4];
#pragma unroll
    for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[4];
      ldmatrix_x4(qa, q_frag + 16 * kk);
#pragma unroll
      for (int n = 0; n < kKeyTiles; n += 2) {
        uint32_t kb[4];  // b0, b1 of key tile n, then of key tile n + 1
        ldmatrix_x4(kb, k_frag + (8 * n) * kLd + 16 * kk);
        mma16816(s[n], qa, kb[0], kb[1], T{});
        mma16816(s[n + 1], qa, kb[2], kb[3], T{});
      }
    }

    // Causal mask and online softmax: element e of s[n] is row g + 8 * (e / 2), key 8n + 2t + e % 2.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[n][2 * i + e];
          x = key0 + 8 * n + 2 * t + e <= limit[i] ? x * qk_scale : -INFINITY;
          tile_max = fmaxf(tile_max, x);
        }
      }
      const float new_max = fmaxf(m[i], lanes_max<4>(tile_max));
      const float alpha = exp2f(m[i] - new_max);
      m[i] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[n][2 * i + e];
          x = exp2f(x - new_max);  // 0 for a masked key
          sum += x;
        }
      }
      l[i] = l[i] * alpha + sum;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        o[n][2 * i] *= alpha;
        o[n][2 * i + 1] *= alpha;
      }
    }
    __syncthreads();  // K tile read by all

    if (kt + 1 < num_tiles) load_kv_tile<T, D, kKeys, kThreads>(s_k, k_cache, key0 + kKeys, a, plan, w);
    cp_async_commit();   // possibly empty: keeps the group count uniform
    cp_async_wait<1>();  // V tile kt is in
    __syncthreads();

#pragma unroll
    for (int j = 0; j < kKeys / 16; ++j) {
      // P's A fragment of keys 16j .. 16j + 15: the C fragments of key tiles 2j and 2j + 1.
      const uint32_t pa[4] = {pack2(s[2 * j][0], s[2 * j][1], T{}), pack2(s[2 * j][2], s[2 * j][3], T{}),
                              pack2(s[2 * j + 1][0], s[2 * j + 1][1], T{}),
                              pack2(s[2 * j + 1][2], s[2 * j + 1][3], T{})};
#pragma unroll
      for (int n = 0; n < kDimTiles; n += 2) {
        uint32_t vb[4];  // b0, b1 of dim tile n, then of dim tile n + 1
        ldmatrix_x4_trans(vb, v_frag + (16 * j) * kLd + 8 * n);
        mma16816(o[n], pa, vb[0], vb[1], T{});
        mma16816(o[n + 1], pa, vb[2], vb[3], T{});
      }
    }
    __syncthreads();  // V tile read by all before the next tile overwrites it
  }
  cp_async_wait<0>();

  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i;
    const float total = lanes_sum<4>(l[i]);
    if (r >= w.rows) continue;
    const float inv = total > 0.f ? 1.f / total : 0.f;  // a row before position 0: zeros
    T* dst = out + (w.first + w.tok0 + r / w.heads) * a.out_stride_row +
             (w.head0 + r % w.heads) * a.out_stride_h;
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      Vec<T, 2> v;
      v.v[0] = from_float<T>(o[n][2 * i] * inv);
      v.v[1] = from_float<T>(o[n][2 * i + 1] * inv);
      *reinterpret_cast<Vec<T, 2>*>(dst + 8 * n + 2 * t) = v;
    }
  }
}

}  // namespace pagedkv::kernels::prefill
