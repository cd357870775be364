// Paged prefill attention on tensor cores (mma.sync m16n8k16, bf16/fp16 in, fp32 accumulate;
// sm_80 and later). 4 warps, each owning kM x 16 of the CTA's rows, flash-attention 2 style:
//   S = Q K^T: Q and K fragments by ldmatrix from shared memory (one K fragment feeds the warp's
//   kM row tiles, so kM = 2 halves the shared-memory reads per mma);
//   causal mask (only on tiles that reach past a row's position) + online softmax on the S
//   accumulators (a row's keys sit in the 4 lanes of a quad);
//   O += P V: the S accumulators, rounded to bf16/fp16, are P's A fragments as they are (no
//   shared-memory round trip); V fragments by ldmatrix.trans.
// K/V tiles are double-buffered: tile j + 1's cp.asyncs are issued before tile j is computed,
// K's and V's together from one table read and address per 16-byte piece (load_kv_tiles).
// With plan.splits > 1 a CTA walks one split of its tile's keys and leaves each row's
// unnormalized output and (max, sum) in the workspace for paged_prefill_merge_kernel.
// kFp8 (an e4m3 cache, one fp32 scale for K and one for V): the double-buffered stages hold the
// cache's bytes, and after each tile lands the CTA converts it, exactly (fp8_convert.cuh), into
// one 16-bit K/V tile that the loop above reads as it is (one more barrier a tile; prefill is
// bound by its mma, not by these copies). K's scale goes into the score scale, V's into O.
// (Fragment layouts: kernels/mma.cuh.)
#pragma once
#include "kernels/fp8_convert.cuh"
#include "kernels/paged_prefill_attention_common.cuh"

namespace pagedkv::kernels::prefill {

namespace mma {
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 2;  // K/V tiles in shared memory: one computed, one landing

// Rows of a CTA with kM row tiles of 16 per warp.
template <int kM>
constexpr int rows() { return kWarps * 16 * kM; }

// Keys per K/V tile. At D = 256 a lane's O accumulators take 128 registers, so S keeps 32 keys.
template <int D>
constexpr int keys() { return D == 256 ? 32 : 64; }

// Q, the 16-bit K/V tiles (kStages of them, or one converted tile with kFp8), then with kFp8 the
// kStages stages of fp8 K/V bytes ([stage][K, V][key][row_stride<uint8_t, D>]).
template <typename T, int D, int kM, bool kFp8 = false>
constexpr int smem_bytes() {
  constexpr int kv_tiles = kFp8 ? 1 : kStages;
  return (rows<kM>() + 2 * kv_tiles * keys<D>()) * row_stride<T, D>() * static_cast<int>(sizeof(T)) +
         (kFp8 ? kStages * 2 * keys<D>() * row_stride<uint8_t, D>() : 0);
}

// Two CTAs an SM: <= 255 registers a thread (kM = 2 at D = 128: 128 O and 64 S accumulators a
// lane) and <= 113 KB of shared memory each (D = 128, kM = 2: 104 KB).
constexpr int kCtasPerSm = 2;
}  // namespace mma

// kOptions: the kernel computes a.sliding_window and a.logit_softcap; without, both are taken as
// off and their code is compiled out (the D = 128 kernel is at its 255 registers: the options'
// code, even unused, cost the plain kernel ~10% in the H100 A/B of its first version).
template <typename T, int D, int kM, bool kOptions, bool kFp8 = false>
__global__ void __launch_bounds__(mma::kThreads, mma::kCtasPerSm) paged_prefill_mma_kernel(const PagedPrefillArgs a,
                                                                         const Plan plan) {
  using namespace mma;
  static_assert(D != 256 || kM == 1, "D = 256 holds one row tile a warp (registers)");
  constexpr int kLd = row_stride<T, D>();
  constexpr int kRows = rows<kM>();
  constexpr int kKeys = keys<D>();
  constexpr int kKeyTiles = kKeys / 8;  // n-tiles of S
  constexpr int kDimTiles = D / 8;      // n-tiles of O
  constexpr int kKvTiles = kFp8 ? 1 : kStages;  // 16-bit K/V tiles
  constexpr int kLd8 = row_stride<uint8_t, D>();  // a staged fp8 row
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);   // [kRows][kLd]
  T* s_k = s_q + kRows * kLd;            // [kKvTiles][kKeys][kLd]
  T* s_v = s_k + kKvTiles * kKeys * kLd; // [kKvTiles][kKeys][kLd]
  uint8_t* s_fp8 = reinterpret_cast<uint8_t*>(s_v + kKvTiles * kKeys * kLd);  // kFp8: [kStages][2][kKeys][kLd8]

  Work w;
  if (!cta_work(a, plan, w)) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;

  // Where tile j's K/V land: the 16-bit stage j % kStages, or (kFp8) fp8 stage j % kStages.
  const auto load_tile = [&](int j, int key0) {
    if constexpr (kFp8) {
      uint8_t* dst = s_fp8 + (j % kStages) * 2 * kKeys * kLd8;
      load_kv_tiles<uint8_t, D, kKeys, kThreads>(dst, dst + kKeys * kLd8, static_cast<const uint8_t*>(a.k_cache),
                                                 static_cast<const uint8_t*>(a.v_cache), key0, a, plan, w);
    } else {
      load_kv_tiles<T, D, kKeys, kThreads>(s_k + (j % kStages) * kKeys * kLd, s_v + (j % kStages) * kKeys * kLd,
                                           static_cast<const T*>(a.k_cache), static_cast<const T*>(a.v_cache),
                                           key0, a, plan, w);
    }
  };

  const int num_tiles = (w.kv_end - w.key_begin + kKeys - 1) / kKeys;
  load_q_tile<T, D, kRows, kThreads>(s_q, a, w);
  if (num_tiles > 0) load_tile(0, w.key_begin);
  cp_async_commit();  // group: Q and K/V tile 0

  // This lane's rows: warp * 16 kM + 16 mt + g + 8i. Their last visible key (position); -1 past
  // w.rows.
  int limit[kM][2];
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = warp * 16 * kM + 16 * mt + g + 8 * i;
      limit[mt][i] = r < w.rows ? w.pos0 + r / w.heads : -1;
    }
  }
  // ldmatrix row addresses. A (Q): lanes 0-7 rows 0-7, 8-15 rows 8-15, 16-31 again at column +8.
  // B (K, keys as n): lanes 0-7 keys 0-7 at d, 8-15 the same keys at d + 8, 16-31 keys 8-15.
  // B (V, keys as k, transposed): lanes 0-7 keys 0-7, 8-15 keys 8-15, 16-31 again at d + 8.
  const T* q_frag = s_q + (warp * 16 * kM + lane % 8 + 8 * ((lane / 8) % 2)) * kLd + 8 * (lane / 16);
  const int k_frag = (lane % 8 + 8 * (lane / 16)) * kLd + 8 * ((lane / 8) % 2);  // offsets in a stage
  const int v_frag = (lane % 8 + 8 * ((lane / 8) % 2)) * kLd + 8 * (lane / 16);

  const float qk_scale = a.scale * kLog2e * (kFp8 ? *a.k_scale : 1.f);  // kFp8: S is Q K's bytes
  float m[kM][2], l[kM][2];  // l: this lane's share of the row sum
  float o[kM][kDimTiles][4];
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) m[mt][i] = kNegBig, l[mt][i] = 0.f;
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.f;
    }
  }

  for (int kt = 0; kt < num_tiles; ++kt) {
    const int key0 = w.key_begin + kt * kKeys;
    const int stage = kt % kStages;
    // Tile kt + 1 into the other stage, which the previous iteration's last barrier freed.
    if (kt + 1 < num_tiles) load_tile(kt + 1, key0 + kKeys);
    cp_async_commit();   // possibly empty: keeps the group count uniform
    cp_async_wait<1>();  // tile kt (and Q) are in
    __syncthreads();
    if constexpr (kFp8) {
      // Each thread converts 16-byte pieces (16 values of one key) of the staged K and V into
      // the 16-bit tile; the last iteration's closing barrier freed it.
      const uint8_t* staged = s_fp8 + stage * 2 * kKeys * kLd8;
      constexpr int kRowPieces = D / 16, kPieces = kKeys * kRowPieces;
      for (int c = threadIdx.x; c < 2 * kPieces; c += kThreads) {
        const int kv = c / kPieces, n = (c % kPieces) / kRowPieces, col = (c % kRowPieces) * 16;
        const uint4 bytes = *reinterpret_cast<const uint4*>(staged + (kv * kKeys + n) * kLd8 + col);
        const uint2 p0 = e4m3x4_to<T>(bytes.x), p1 = e4m3x4_to<T>(bytes.y);
        const uint2 p2 = e4m3x4_to<T>(bytes.z), p3 = e4m3x4_to<T>(bytes.w);
        T* dst = (kv == 0 ? s_k : s_v) + n * kLd + col;
        *reinterpret_cast<uint4*>(dst) = make_uint4(p0.x, p0.y, p1.x, p1.y);
        *reinterpret_cast<uint4*>(dst + 8) = make_uint4(p2.x, p2.y, p3.x, p3.y);
      }
      __syncthreads();
    }
    const int tile = kFp8 ? 0 : stage;
    const T* k_tile = s_k + tile * kKeys * kLd + k_frag;
    const T* v_tile = s_v + tile * kKeys * kLd + v_frag;

    float s[kM][kKeyTiles][4];
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) ldmatrix_x4(qa[mt], q_frag + 16 * mt * kLd + 16 * kk);
#pragma unroll
      for (int n = 0; n < kKeyTiles; n += 2) {
        uint32_t kb[4];  // b0, b1 of key tile n, then of key tile n + 1
        ldmatrix_x4(kb, k_tile + (8 * n) * kLd + 16 * kk);
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          mma16816(s[mt][n], qa[mt], kb[0], kb[1], T{});
          mma16816(s[mt][n + 1], qa[mt], kb[2], kb[3], T{});
        }
      }
    }

    // The options are read from the kernel's parameters where used (no registers held across
    // the loop: the D = 128 kernel is at its 255). A softcap caps the scaled scores and divides
    // the scale back out, so the mask's multiply below stays as it is.
    if (kOptions && a.logit_softcap > 0.f) {
      const float cap2 = a.logit_softcap * kLog2e, inv_scale = 1.f / qk_scale;
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[mt][n][e] = softcap_log2<T>(s[mt][n][e] * qk_scale, cap2) * inv_scale;
          }
        }
      }
    }

    // Causal (and window) mask and online softmax: element e of s[mt][n] is row g + 8 * (e / 2)
    // of row tile mt, key 8n + 2t + e % 2. Row 0 of the CTA sees the fewest keys (up to w.pos0),
    // so a tile ending at or before it needs no causal mask. A row sees keys j > its position -
    // window; the CTA's last row is at most pos0 + kRows - 1, so a tile from pos0 + kRows -
    // window on needs no window mask (written without overflow for windows up to 2^31 - 1).
    const int window = kOptions ? a.sliding_window : 0;
    const bool mask = key0 + kKeys - 1 > w.pos0 || (window > 0 && w.pos0 + kRows - key0 > window);
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mt][n][2 * i + e];
            const int key = key0 + 8 * n + 2 * t + e;
            const bool in_window = window == 0 || limit[mt][i] - key < window;
            x = !mask || (key <= limit[mt][i] && in_window) ? x * qk_scale : -INFINITY;
            tile_max = fmaxf(tile_max, x);
          }
        }
        const float new_max = fmaxf(m[mt][i], lanes_max<4>(tile_max));
        const float alpha = exp2f(m[mt][i] - new_max);
        m[mt][i] = new_max;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[mt][n][2 * i + e];
            x = exp2f(x - new_max);  // 0 for a masked key
            sum += x;
          }
        }
        l[mt][i] = l[mt][i] * alpha + sum;
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          o[mt][n][2 * i] *= alpha;
          o[mt][n][2 * i + 1] *= alpha;
        }
      }
    }

#pragma unroll
    for (int j = 0; j < kKeys / 16; ++j) {
      // P's A fragment of keys 16j .. 16j + 15: the C fragments of key tiles 2j and 2j + 1.
      uint32_t pa[kM][4];
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        const float(&lo)[4] = s[mt][2 * j];
        const float(&hi)[4] = s[mt][2 * j + 1];
        pa[mt][0] = pack2(lo[0], lo[1], T{});
        pa[mt][1] = pack2(lo[2], lo[3], T{});
        pa[mt][2] = pack2(hi[0], hi[1], T{});
        pa[mt][3] = pack2(hi[2], hi[3], T{});
      }
#pragma unroll
      for (int n = 0; n < kDimTiles; n += 2) {
        uint32_t vb[4];  // b0, b1 of dim tile n, then of dim tile n + 1
        ldmatrix_x4_trans(vb, v_tile + (16 * j) * kLd + 8 * n);
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
          mma16816(o[mt][n], pa[mt], vb[0], vb[1], T{});
          mma16816(o[mt][n + 1], pa[mt], vb[2], vb[3], T{});
        }
      }
    }
    __syncthreads();  // this stage read by all before iteration kt + 1 loads tile kt + 2 into it
  }
  cp_async_wait<0>();
  if constexpr (kFp8) {  // O was summed over V's bytes
    const float v_scale = *a.v_scale;
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][n][e] *= v_scale;
      }
    }
  }

#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = warp * 16 * kM + 16 * mt + g + 8 * i;
      const float total = lanes_sum<4>(l[mt][i]);
      if (r >= w.rows) continue;
      if (plan.splits > 1) {
        const SplitRow part = split_row(a, plan, w, r, cta_split(a, plan));
#pragma unroll
        for (int n = 0; n < kDimTiles; ++n) {
          *reinterpret_cast<float2*>(part.out + 8 * n + 2 * t) =
              make_float2(o[mt][n][2 * i], o[mt][n][2 * i + 1]);
        }
        if (t == 0) *part.stats = make_float2(m[mt][i], total);
        continue;
      }
      const float inv = a.sinks != nullptr ? inv_sum_with_sink(m[mt][i], total, a.sinks[w.head0 + r % w.heads])
                                           : total > 0.f ? 1.f / total : 0.f;  // before position 0: zeros
      T* dst = output_row<T>(a, w, r);
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        Vec<T, 2> v;
        v.v[0] = from_float<T>(o[mt][n][2 * i] * inv);
        v.v[1] = from_float<T>(o[mt][n][2 * i + 1] * inv);
        *reinterpret_cast<Vec<T, 2>*>(dst + 8 * n + 2 * t) = v;
      }
    }
  }
}

}  // namespace pagedkv::kernels::prefill
