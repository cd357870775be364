// Paged decode attention. One thread block (CTA) per (sequence, kv head, split, head chunk); it
// serves all query heads of that kv head (GQA: each K/V row is read once for the whole group).
// Inside a CTA, 4 warps (8 on tensor cores for a grid of at most one CTA per SM, unsplit or in
// splits of >= 512 tokens: paged_decode_warps) take turns over the split's tokens, each with its
// own fp32 online softmax (max, sum, output), merged through shared memory at the end. Two main
// loops:
//   - tensor cores (paged_decode_attention_mma.cuh; bf16/fp16 at head_dim 64 and 128, so W1 and
//     W3):
//     per warp a 2-stage cp.async ring of 8-token K/V tiles, scores and the weighted sum as
//     mma.sync tiles (at most 116 registers, 4 CTAs of 4 warps per SM);
//   - CUDA cores (below; fp32, head_dim 256): a token row of one kv head is read by kLanes lanes
//     with 16-byte loads that bypass L1 (every row is read once), so a warp reads 32 / kLanes
//     tokens side by side and kSteps of those per iteration: every lane has kSteps K and kSteps V
//     loads in flight before it computes, and the next iteration's too where registers allow.
//     Each lane keeps the scaled query slice of every head of the group and its online softmax
//     for the tokens its lane group saw; the lane groups merge by shuffles.
// Scores are kept in log2 units (the query is pre-scaled by scale * log2(e)), so exp2 suffices.
//
// With num_splits > 1 each CTA of a sequence that spans several splits writes its normalized
// partial output and (max, sum) to the workspace, and the last CTA of the sequence's head chunk
// to finish (an atomic counter in the workspace) merges them: one launch in all, where a second
// combine kernel cost ~1 us per call at small batch.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/paged_decode_attention.h"
#include "kernels/paged_decode_attention_common.cuh"
#include "kernels/paged_decode_attention_mma.cuh"

namespace pagedkv::kernels {
namespace {

using namespace decode;

// How lanes share the work of one token row for element type T and head dim D, GQA group G.
template <typename T, int D, int G>
struct Tile {
  static constexpr int kVec = 16 / sizeof(T);                       // elements per 16-byte load
  static constexpr int kLanes = D / kVec < 32 ? D / kVec : 32;      // lanes per token row
  static constexpr int kVecsPerLane = D / (kVec * kLanes);          // 16-byte loads per row, lane
  static constexpr int kElems = kVecsPerLane * kVec;                // head_dim elements per lane
  static constexpr int kTokensSideBySide = 32 / kLanes;             // tokens per warp load
  // Loads in flight per lane: 4 K + 4 V rows; halved when the group's registers are large.
  static constexpr int kSteps = std::max(1, (G >= 8 ? 2 : 4) / kVecsPerLane);
  static constexpr int kTokensPerIter = kTokensSideBySide * kSteps;  // per warp
  static_assert(D % (kVec * kLanes) == 0, "head_dim must be a multiple of 16 bytes x lanes");
};

// What the kernels need beyond PagedDecodeArgs, computed on the host.
struct Plan {
  int group_size;        // num_q_heads / num_kv_heads
  int head_chunks;       // CTAs that split one kv head's group of query heads
  int chunk_heads;       // query heads per chunk (the last chunk may have fewer)
  int block_shift;       // log2(block_size)
  int tokens_per_split;  // a multiple of block_size
  int max_tokens;        // max_blocks * block_size: context_lens are clamped to it
  int64_t counter_floats;  // workspace floats before the partials: paged_decode_counter_floats
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

__device__ __forceinline__ int clamp_context(const int* context_lens, int b, int max_tokens) {
  return min(max(context_lens[b], 0), max_tokens);
}

// Four consecutive outputs of one head: to T in `out`, or fp32 partials in the workspace.
template <typename T>
__device__ __forceinline__ void store4(T* dst, const float (&o)[4]) {
  Vec<T, 4> v;
#pragma unroll
  for (int j = 0; j < 4; ++j) v.v[j] = from_float<T>(o[j]);
  *reinterpret_cast<Vec<T, 4>*>(dst) = v;
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
// s_sum as mma_warp_loop leaves it.
template <typename T, int D, int G>
__device__ __forceinline__ void simt_warp_loop(const PagedDecodeArgs& a, const Plan& plan, int b,
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
      const uint4 raw = h < heads ? load16(q_base + h * a.q_stride_h + (n * kLanes + sub) * kVec)
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
  const int slot_mask = (1 << plan.block_shift) - 1;
  constexpr int kWarpStride = kWarps * Tl::kTokensPerIter;

  // Physical blocks of this lane's tokens, fetched one iteration ahead of the K/V loads that use
  // them. A lane past the end reads the last token again instead (no branch around its loads; its
  // score is masked): table entries past the context are never read.
  int phys[kSteps];
  auto fetch_blocks = [&](int base) {
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int t = min(base + u * kSide + side, end - 1);
      phys[u] = __ldg(table + (t >> plan.block_shift));
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
        kr[u][n] = load16_stream(k_cache + row + n * kLanes * kVec);
        vr[u][n] = load16_stream(v_cache + row + n * kLanes * kVec);
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

// Dynamic shared memory of paged_decode_kernel with W warps: the merge's [W][G][D] partial
// outputs; with kMma, at least the main loop's rings (the same bytes). Dynamic, since the wide
// CTA's 64 KB of rings pass the 48 KB static limit.
template <typename T, int D, int G, bool kMma, int W>
constexpr int smem_bytes() {
  constexpr int merge = W * G * D * static_cast<int>(sizeof(float));
  return kMma ? std::max(merge, ring_bytes<T, D, W>()) : merge;
}

// kMma: the tensor-core main loop (paged_decode_attention_mma.cuh) instead of the CUDA-core one
// above.
// W: warps per CTA, kWarps or (tensor cores only) 8 (paged_decode_warps); the launch bounds keep
// the registers of kWarps-warp CTAs at the same warps per SM.
template <typename T, int D, int G, bool kMma, int W>
__global__ void __launch_bounds__(W * 32, paged_ctas_per_sm(G, kMma) * kWarps / W)
paged_decode_kernel(const PagedDecodeArgs a, const Plan plan) {
  begin_dependent_kernel();
  static_assert(W == kWarps || kMma, "the CUDA-core loop runs kWarps warps");
  constexpr int kThreads = W * 32;
  // blockIdx.x = ((b * num_kv_heads + kv_head) * num_splits + split) * head_chunks + chunk:
  // the CTAs that read the same K/V rows are neighbours (L2 serves the other head chunks).
  int idx = blockIdx.x;
  const int chunk = idx % plan.head_chunks;
  idx /= plan.head_chunks;
  const int split = idx % a.num_splits;
  idx /= a.num_splits;
  const int kv_head = idx % a.num_kv_heads;
  const int b = idx / a.num_kv_heads;

  const int begin = split * plan.tokens_per_split;
  // The block of this warp's first tile, read beside the context length instead of after it
  // (it does not depend on it): one dependent read less before the first K/V copies.
  int first_block = 0;
  if constexpr (kMma) {
    const int first = begin + (threadIdx.x / 32) * kStageTokens;
    if (first < plan.max_tokens) {
      first_block = __ldg(a.block_tables + static_cast<int64_t>(b) * a.max_blocks +
                          (first >> plan.block_shift));
    }
  }
  const int ctx = clamp_context(a.context_lens, b, plan.max_tokens);
  const int end = min(begin + plan.tokens_per_split, ctx);
  const int head0 = kv_head * plan.group_size + chunk * plan.chunk_heads;  // first query head
  const int heads = min(plan.chunk_heads, plan.group_size - chunk * plan.chunk_heads);

  T* out = static_cast<T*>(a.out) + b * a.out_stride_row + head0 * a.out_stride_h;
  if (begin >= end) {
    // Nothing to read. Split 0 of a padding row (context 0) writes its zeros; other splits past
    // the context are not counted by the merge below.
    if (split == 0) {
      const float zero[4] = {0.f, 0.f, 0.f, 0.f};
      for (int i = threadIdx.x; i < heads * (D / 4); i += kThreads) {
        store4(out + (i / (D / 4)) * a.out_stride_h + (i % (D / 4)) * 4, zero);
      }
    }
    return;
  }

  // The warps' partial outputs, maxima and sums, merged below. With kMma the partial outputs
  // take the bytes of the main loop's rings (written after it).
  // smem_bytes<T, D, G, kMma, W>(). 128-byte aligned: placed after the static arrays at a 16-byte
  // boundary, the rings' swizzled tiles straddle 128-byte lines, and the tensor-core loop ran
  // 7-12% slower on an H100 (sessions 9-10; as fast as static memory when aligned).
  extern __shared__ __align__(128) unsigned char smem[];
  float (*s_acc)[G][D] = reinterpret_cast<float (*)[G][D]>(smem);
  __shared__ float s_max[W][G];
  __shared__ float s_sum[W][G];
  if constexpr (kMma) {
    mma_warp_loop<T, D, G, W>(a, plan.block_shift, b, kv_head, head0, heads, begin, end,
                              first_block, smem, s_acc, s_max, s_sum);
  } else {
    simt_warp_loop<T, D, G>(a, plan, b, kv_head, head0, heads, begin, end, s_acc, s_max, s_sum);
  }
  __syncthreads();

  // Splits holding part of this sequence's context. With one, the CTA has the whole softmax and
  // writes the output directly (short contexts of a split bucket skip the workspace).
  const int active = (ctx + plan.tokens_per_split - 1) / plan.tokens_per_split;
  const int64_t row0 = (static_cast<int64_t>(b) * a.num_q_heads + head0) * a.num_splits;
  // Workspace: merge counters [batch, num_q_heads] (int32, padded to 16 bytes), partial outputs
  // [batch, num_q_heads, num_splits, D] (normalized), then (max, sum) [batch, num_q_heads,
  // num_splits]. Counters first, so a call of a smaller batch finds its counters zero too.
  int* counters = reinterpret_cast<int*>(a.workspace);
  float* partials = a.workspace + plan.counter_floats;
  float2* stats = reinterpret_cast<float2*>(
      partials + static_cast<int64_t>(a.batch) * a.num_q_heads * a.num_splits * D);
  for (int i = threadIdx.x; i < heads * (D / 4); i += kThreads) {
    const int h = i / (D / 4);
    const int d = (i % (D / 4)) * 4;
    float max_all = kNegBig;
#pragma unroll
    for (int w = 0; w < W; ++w) max_all = fmaxf(max_all, s_max[w][h]);
    float sum = 0.f;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float weight = exp2f(s_max[w][h] - max_all);  // 0 for a warp that saw no token
      sum += weight * s_sum[w][h];
      const float4 x = *reinterpret_cast<const float4*>(&s_acc[w][h][d]);
      o[0] += weight * x.x;
      o[1] += weight * x.y;
      o[2] += weight * x.z;
      o[3] += weight * x.w;
    }
    const float inv = 1.f / sum;  // sum >= 1: the split holds at least one token
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] *= inv;
    if (active == 1) {
      store4(out + h * a.out_stride_h + d, o);
    } else {
      const int64_t row = row0 + h * a.num_splits + split;
      store4(partials + row * D + d, o);
      if (d == 0) stats[row] = make_float2(max_all, sum);
    }
  }
  if (active == 1) return;

  // The last of the `active` CTAs of this (sequence, head chunk) to finish merges the splits
  // (one launch instead of a second combine kernel). Each thread publishes its partials, then
  // one thread counts the CTA in; the counter is reset by the last, ready for the next launch.
  __shared__ bool s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = counters + b * a.num_q_heads + head0;
    s_last = atomicAdd(counter, 1) == active - 1;
    if (s_last) *counter = 0;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // The splits' (max, sum) and partials were written by other CTAs: read them through L2
  // (__ldcg), never a stale L1 line. One pass: each thread merges its 4 outputs of one head over
  // the splits with an online (max, sum), every split's reads independent of the others (8 in
  // flight), so the merge waits for one round of L2 reads, not one per split or per pass.
  for (int i = threadIdx.x; i < heads * (D / 4); i += kThreads) {
    const int h = i / (D / 4);
    const int d = (i % (D / 4)) * 4;
    const int64_t row = row0 + h * a.num_splits;
    float max_all = kNegBig, sum = 0.f;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
    for (int sp = 0; sp < active; ++sp) {
      const float2 st = __ldcg(&stats[row + sp]);
      const float4 x = __ldcg(reinterpret_cast<const float4*>(partials + (row + sp) * D + d));
      const float new_max = fmaxf(max_all, st.x);
      const float rescale = exp2f(max_all - new_max);
      const float weight = exp2f(st.x - new_max) * st.y;
      sum = fmaf(sum, rescale, weight);
      o[0] = fmaf(o[0], rescale, weight * x.x);
      o[1] = fmaf(o[1], rescale, weight * x.y);
      o[2] = fmaf(o[2], rescale, weight * x.z);
      o[3] = fmaf(o[3], rescale, weight * x.w);
      max_all = new_max;
    }
    const float inv = 1.f / sum;  // sum >= 1: the split holding the max adds >= 1
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] *= inv;
    store4(out + h * a.out_stride_h + d, o);
  }
}

int log2_exact(int x) {
  int shift = 0;
  while ((1 << shift) < x) ++shift;
  return shift;
}

template <typename T, int D, int G, int W>
cudaError_t launch_warps(const PagedDecodeArgs& a, const Plan& plan, int64_t ctas,
                         cudaStream_t stream) {
  constexpr bool kMma = paged_decode_tensor_cores(D, sizeof(T));
  constexpr int smem = smem_bytes<T, D, G, kMma, W>();
  const auto kernel = paged_decode_kernel<T, D, G, kMma, W>;
  if constexpr (smem > 48 * 1024) {  // the opt-in past 48 KB, per device: set at every launch
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  launch_dependent(kernel, static_cast<unsigned>(ctas), W * 32, smem, stream, a, plan);
  return cudaGetLastError();
}

template <typename T, int D, int G>
cudaError_t launch_main(const PagedDecodeArgs& a, const Plan& plan, int warps, int64_t ctas,
                        cudaStream_t stream) {
  if constexpr (paged_decode_tensor_cores(D, sizeof(T))) {
    if (warps == 8) return launch_warps<T, D, G, 8>(a, plan, ctas, stream);
  }
  return launch_warps<T, D, G, kWarps>(a, plan, ctas, stream);
}

template <typename T, int D>
cudaError_t launch(const PagedDecodeArgs& a, const Plan& plan, int padded_group, int warps,
                   int64_t ctas, cudaStream_t stream) {
  switch (padded_group) {
    case 1: return launch_main<T, D, 1>(a, plan, warps, ctas, stream);
    case 2: return launch_main<T, D, 2>(a, plan, warps, ctas, stream);
    case 4: return launch_main<T, D, 4>(a, plan, warps, ctas, stream);
    case 8: return launch_main<T, D, 8>(a, plan, warps, ctas, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t paged_decode_attention(const PagedDecodeArgs& a, DType dtype, cudaStream_t stream) {
  if (a.batch == 0 || a.num_q_heads == 0) return cudaSuccess;
  if (a.num_splits < 1 || a.max_blocks < 1 || a.num_kv_heads < 1 ||
      a.num_q_heads % a.num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  const HeadGroups g = paged_head_groups(a.num_q_heads, a.num_kv_heads);
  const int blocks_per_split = static_cast<int>(paged_blocks_per_split(a.max_blocks, a.num_splits));
  Plan plan;
  plan.group_size = g.group_size;
  plan.head_chunks = g.chunks;
  plan.chunk_heads = g.chunk_heads;
  plan.block_shift = log2_exact(a.block_size);
  plan.tokens_per_split = blocks_per_split * a.block_size;
  plan.max_tokens = a.max_blocks * a.block_size;
  plan.counter_floats = paged_decode_counter_floats(a.batch, a.num_q_heads);
  const int64_t ctas = static_cast<int64_t>(a.batch) * a.num_kv_heads * a.num_splits * g.chunks;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  // 8 on tensor cores only (launch_main).
  const int warps = paged_decode_warps(a.num_splits, ctas, a.num_sms, plan.tokens_per_split);

  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (a.head_dim) {
      case 64: return launch<T, 64>(a, plan, g.padded, warps, ctas, stream);
      case 128: return launch<T, 128>(a, plan, g.padded, warps, ctas, stream);
      case 256: return launch<T, 256>(a, plan, g.padded, warps, ctas, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace pagedkv::kernels
