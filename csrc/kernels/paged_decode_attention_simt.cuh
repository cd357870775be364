// The main loop of paged decode attention on CUDA cores (fp32, head_dim 256, and head_dim 80 or
// 96 in any dtype; bf16/fp16 at 64 and 128 take the tensor-core loop in
// paged_decode_attention_mma.cuh): a token row of one kv head is read by kLanes lanes with 16-byte
// loads that bypass L1 (every row is read once), so a warp reads 32 / kLanes tokens side by side
// and kSteps of those per iteration: every lane has kSteps K and kSteps V loads in flight before
// it computes, and the next iteration's too where registers allow. Each lane keeps the scaled
// query slice of every head of the group and its online softmax for the tokens its lane group
// saw; the lane groups merge by shuffles.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/common.cuh"
#include "kernels/paged_decode_attention.h"
#include "kernels/paged_decode_attention_common.cuh"

namespace pagedkv::kernels::decode {

constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }

// How lanes share the work of one token row for element type T and head dim D, GQA group G.
// A row's kRowVecs 16-byte vectors go to a power of two of lanes (shuffles stay inside the lane
// group): at head_dim 64, 128, 256 they divide evenly; at 80 or 96 (kPadded) the lanes past the
// row's last vector load nothing and hold zeros (bf16 80: 10 vectors on 16 lanes).
template <typename T, int D, int G>
struct Tile {
  static constexpr int kVec = 16 / sizeof(T);                       // elements per 16-byte load
  static constexpr int kRowVecs = D / kVec;                         // 16-byte loads per row
  static constexpr int kLanes = std::min(32, pow2_ceil(kRowVecs));  // lanes per token row
  static constexpr int kVecsPerLane = (kRowVecs + kLanes - 1) / kLanes;  // loads per row, lane
  static constexpr bool kPadded = kVecsPerLane * kLanes != kRowVecs;
  static constexpr int kElems = kVecsPerLane * kVec;                // head_dim elements per lane
  static constexpr int kTokensSideBySide = 32 / kLanes;             // tokens per warp load
  // Loads in flight per lane: 4 K + 4 V rows; halved when the group's registers are large.
  static constexpr int kSteps = std::max(1, (G >= 8 ? 2 : 4) / kVecsPerLane);
  static constexpr int kTokensPerIter = kTokensSideBySide * kSteps;  // per warp
  static_assert(D % kVec == 0, "head_dim must be a multiple of 16 bytes");
  // Whether vector n of lane `sub` lies in the row (always, unpadded).
  static __device__ __forceinline__ bool in_row(int n, int sub) {
    return !kPadded || n * kLanes + sub < kRowVecs;
  }
};

__device__ __forceinline__ uint4 load16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 16 loaded bytes -> 16 / sizeof(T) floats. bf16 is the top half of an fp32, so one shift or
// mask per element (going through __nv_bfloat16 values costs ~3 instructions per element).
__device__ __forceinline__ void unpack16(const uint4& raw, float* f, __nv_bfloat16) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack16(const uint4& raw, float* f, __half) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h;
    memcpy(&h, &w[i], 4);
    const float2 x = __half22float2(h);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void unpack16(const uint4& raw, float* f, float) {
  f[0] = __uint_as_float(raw.x);
  f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z);
  f[3] = __uint_as_float(raw.w);
}

// One round of a reduce-scatter over lanes `O` apart, then the rounds below it: a lane keeps the
// upper half of its 2 * O values if it has bit O set, the lower half otherwise, and adds its
// partner's copy of that half. After the round of O = 1, v[0] of the lane whose bits are i is
// the sum of value i over the 2 * O lanes. (A template per round: a loop over O left the inner
// loop's bounds unknown, and it was compiled as a loop indexing registers through moves.)
template <int O, int N>
__device__ __forceinline__ void reduce_scatter(float (&v)[N], int lane) {
  if constexpr (O > 0) {
    const bool upper = lane & O;
#pragma unroll
    for (int j = 0; j < O; ++j) {
      const float send = upper ? v[j] : v[j + O];
      const float keep = upper ? v[j + O] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    reduce_scatter<O / 2>(v, lane);
  }
}

// The CUDA-core main loop: one warp's share of the split [begin, end), left in s_acc, s_max and
// s_sum as mma_warp_loop leaves it. (A sliding window moved begin to its first key.)
template <typename T, int D, int G>
__device__ __forceinline__ void simt_warp_loop(const PagedDecodeArgs& a, int block_shift, int b,
                                               int kv_head, int head0, int heads, int begin,
                                               int end, float (*s_acc)[G][D], float (*s_max)[G],
                                               float (*s_sum)[G]) {
  using Tl = Tile<T, D, G>;
  constexpr int kVec = Tl::kVec, kLanes = Tl::kLanes, kNv = Tl::kVecsPerLane, kE = Tl::kElems;
  constexpr int kSide = Tl::kTokensSideBySide, kSteps = Tl::kSteps;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int side = lane / kLanes;  // which of the side-by-side tokens this lane reads
  const int sub = lane % kLanes;   // which slice of head_dim: vectors sub, sub + kLanes, ...

  // Query slices, pre-scaled so that q.k is the score in log2 units. Heads past `heads` (the
  // group padded up to G) get zeros and are never written.
  float q[G][kE];
  const float q_scale = a.scale * kLog2e;
  const T* q_base = static_cast<const T*>(a.q) + b * a.q_stride_row + head0 * a.q_stride_h;
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int n = 0; n < kNv; ++n) {
      const uint4 raw = h < heads && Tl::in_row(n, sub)
                            ? load16(q_base + h * a.q_stride_h + (n * kLanes + sub) * kVec)
                            : make_uint4(0, 0, 0, 0);
      unpack16(raw, &q[h][n * kVec], T{});
#pragma unroll
      for (int j = 0; j < kVec; ++j) q[h][n * kVec + j] *= q_scale;
    }
  }

  float m[G], l[G], acc[G][kE];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = kNegBig;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[h][e] = 0.f;
  }

  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks;
  const int64_t token_stride = a.cache_stride_token;  // between block slots
  const int64_t block_stride = a.cache_stride_block;
  const int64_t lane_offset = kv_head * a.cache_stride_head + sub * kVec;
  const int slot_mask = (1 << block_shift) - 1;
  constexpr int kWarpStride = kWarps * Tl::kTokensPerIter;

  // Physical blocks of this lane's tokens, fetched one iteration ahead of the K/V loads that use
  // them. A lane past the end reads the last token again instead (no branch around its loads; its
  // score is masked): table entries past the context are never read.
  int phys[kSteps];
  auto fetch_blocks = [&](int base) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int t = min(base + u * kSide + side, end - 1);
      phys[u] = __ldg(table + (t >> block_shift));
    }
  };
  uint4 kr[kSteps][kNv], vr[kSteps][kNv];
  auto load_kv = [&](int base) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int t = min(base + u * kSide + side, end - 1);
      const int64_t row = phys[u] * block_stride + (t & slot_mask) * token_stride + lane_offset;
#pragma unroll
      for (int n = 0; n < kNv; ++n) {
        if (Tl::in_row(n, sub)) {
          kr[u][n] = load16_stream(k_cache + row + n * kLanes * kVec);
          vr[u][n] = load16_stream(v_cache + row + n * kLanes * kVec);
        } else {  // a padding lane: zeros add nothing to the scores and fill unused dims
          kr[u][n] = make_uint4(0, 0, 0, 0);
          vr[u][n] = make_uint4(0, 0, 0, 0);
        }
      }
    }
  };
  // Pipelined: the next iteration's K/V loads are issued before this iteration's arithmetic, so a
  // warp keeps bytes in flight while it computes (registers allowing: not the 8-head groups).
  constexpr bool kPipelined = G < 8;
  // Scores summed by a reduce-scatter when a token's lanes hold as many scores as there are lanes
  // (W1's and W3's shapes: 16 lanes, 2 x 8 or 4 x 4 scores); else by an all-reduce.
  constexpr int kN = kSteps * G;
  constexpr bool kScatter = kN == kLanes;
  int t0 = begin + warp * Tl::kTokensPerIter;
  fetch_blocks(t0);
  if constexpr (kPipelined) {
    load_kv(t0);
    fetch_blocks(t0 + kWarpStride);
  }

  for (; t0 < end; t0 += kWarpStride) {  // t0 is warp-uniform: shuffles below see all lanes
    if constexpr (!kPipelined) {
      load_kv(t0);
      fetch_blocks(t0 + kWarpStride);
    }
    uint4 kc[kSteps][kNv], vc[kSteps][kNv];  // this iteration's rows
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
#pragma unroll
      for (int n = 0; n < kNv; ++n) {
        kc[u][n] = kr[u][n];
        vc[u][n] = vr[u][n];
      }
    }
    if constexpr (kPipelined) {
      if (t0 + kWarpStride < end) {
        load_kv(t0 + kWarpStride);
        fetch_blocks(t0 + 2 * kWarpStride);
      }
    }

    // Scores: partial dot products over this lane's slice, summed over the kLanes lanes of the
    // token (xor offsets below kLanes stay inside the lane group).
    float s[kSteps][G];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float kf[kE];
#pragma unroll
      for (int n = 0; n < kNv; ++n) unpack16(kc[u][n], &kf[n * kVec], T{});
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kE; ++e) dot = fmaf(q[h][e], kf[e], dot);
        s[u][h] = dot;
      }
    }
    if constexpr (kScatter) {
      // Reduce-scatter (reduce_scatter above): lane `sub` ends with the whole score of token
      // u = sub / G, head h = sub % G. kN - 1 shuffles where the all-reduce takes
      // kN * log2(kLanes), and each score's softmax is computed once, not on every lane of the
      // token.
      float v[kN];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
#pragma unroll
        for (int h = 0; h < G; ++h) v[u * G + h] = s[u][h];
      }
      reduce_scatter<kLanes / 2>(v, sub);
      const int my_u = sub / G, my_h = sub % G;
      const bool my_valid = t0 + my_u * kSide + side < end;
      // The softcap: a uniform branch, its cap read from the parameters (no register held).
      if (a.logit_softcap > 0.f) v[0] = softcap_log2<T>(v[0], a.logit_softcap * kLog2e);
      float my_max = my_valid ? v[0] : kNegBig;  // over this head's tokens: lanes sub ^ (G << k)
#pragma unroll
      for (int o = G; o < kLanes; o <<= 1) {
        my_max = fmaxf(my_max, __shfl_xor_sync(0xffffffffu, my_max, o));
      }
      float m_mine = m[0];  // m[my_h] (picked without indexing a register array), then its new max
#pragma unroll
      for (int h = 1; h < G; ++h) m_mine = my_h == h ? m[h] : m_mine;
      // Lazy rescaling: the running max moves only when a score exceeds it by more than
      // kRescaleSlack (log2 units), so most iterations skip the rescale of acc and l (G exp2 and
      // G * kE multiplies) and weights stay <= 2^kRescaleSlack, far from fp32's range. Any
      // (max, sum, acc) with acc and sum relative to the same max merge correctly below.
      const bool grows = my_max > m_mine + kRescaleSlack;
      if (__any_sync(0xffffffffu, grows)) {  // warp-uniform: all lanes reach the shuffles
        m_mine = fmaxf(my_max, m_mine);
        // The heads' new maxima back to every lane of the token (lane h holds u = 0, head h).
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float new_max = __shfl_sync(0xffffffffu, m_mine, h, kLanes);
          const float alpha = fast_exp2(m[h] - new_max);
          m[h] = new_max;
          l[h] *= alpha;
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[h][e] *= alpha;
        }
      }
      // All probability weights back to every lane of the token, into s.
      const float my_weight = my_valid ? fast_exp2(v[0] - m_mine) : 0.f;
#pragma unroll
      for (int h = 0; h < G; ++h) {
#pragma unroll
        for (int u = 0; u < kSteps; ++u) {
          s[u][h] = __shfl_sync(0xffffffffu, my_weight, u * G + h, kLanes);
          l[h] += s[u][h];
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
#pragma unroll
          for (int offset = kLanes / 2; offset > 0; offset >>= 1) {
            s[u][h] += __shfl_xor_sync(0xffffffffu, s[u][h], offset);
          }
        }
      }
      if (a.logit_softcap > 0.f) {
#pragma unroll
        for (int u = 0; u < kSteps; ++u) {
#pragma unroll
          for (int h = 0; h < G; ++h) s[u][h] = softcap_log2<T>(s[u][h], a.logit_softcap * kLog2e);
        }
      }

      // Online softmax: new running max, rescale what was accumulated, add this iteration.
      bool valid[kSteps];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) valid[u] = t0 + u * kSide + side < end;
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float new_max = m[h];
#pragma unroll
        for (int u = 0; u < kSteps; ++u) {
          if (valid[u]) new_max = fmaxf(new_max, s[u][h]);
        }
        const float alpha = fast_exp2(m[h] - new_max);
        m[h] = new_max;
        l[h] *= alpha;
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[h][e] *= alpha;
#pragma unroll
        for (int u = 0; u < kSteps; ++u) {
          s[u][h] = valid[u] ? fast_exp2(s[u][h] - new_max) : 0.f;  // now the probability weight
          l[h] += s[u][h];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float vf[kE];
#pragma unroll
      for (int n = 0; n < kNv; ++n) unpack16(vc[u][n], &vf[n * kVec], T{});
#pragma unroll
      for (int h = 0; h < G; ++h) {
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[h][e] = fmaf(s[u][h], vf[e], acc[h][e]);
      }
    }
  }

  // Merge the side-by-side lane groups of the warp (they hold the same head_dim slices).
#pragma unroll
  for (int offset = kLanes; offset < 32; offset <<= 1) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[h], offset);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[h], offset);
      const float new_max = fmaxf(m[h], m_other);
      const float mine = exp2f(m[h] - new_max);
      const float theirs = exp2f(m_other - new_max);
      l[h] = l[h] * mine + l_other * theirs;
      m[h] = new_max;
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, acc[h][e], offset);
        acc[h][e] = acc[h][e] * mine + other * theirs;
      }
    }
  }

  // The warp's share to shared memory, merged by the caller.
  if (side == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
#pragma unroll
      for (int n = 0; n < kNv; ++n) {
        if (!Tl::in_row(n, sub)) continue;
#pragma unroll
        for (int j = 0; j < kVec; ++j) s_acc[warp][h][(n * kLanes + sub) * kVec + j] = acc[h][n * kVec + j];
      }
      if (sub == 0) {
        s_max[warp][h] = m[h];
        s_sum[warp][h] = l[h];
      }
    }
  }
}

}  // namespace pagedkv::kernels::decode
