// The main loop of paged decode attention on tensor cores (bf16/fp16, head_dim 64 or 128, block
// size >= 8; the rest take the CUDA-core loop in paged_decode_attention.cu). Per warp, 8 tokens
// at a time:
//   - a per-warp ring of kStages shared-memory stages, each one 8-token K tile and V tile, filled
//     by cp.async (no CTA barrier: a warp reads only its own stages) while the warp computes on
//     the oldest;
//   - S = Q K^T as m16n8k16 tiles: M = the group's query heads (rows g; rows g + 8 are zeros),
//     N = the 8 tokens, K = head_dim. Q's A fragments stay in registers for the whole loop; K's B
//     fragments come by ldmatrix (a token row is a row of the 8 x 8 matrices);
//   - the online softmax on S's accumulators: lane (g, t) holds head g's scores of tokens 2t and
//     2t + 1, so a head's max over the 8 tokens is two shuffles within the quad;
//   - O^T += V^T P^T as m16n8k8 tiles: M = head_dim, N = the heads, K = the 8 tokens. S's
//     accumulators, rounded to bf16/fp16, are P^T's B fragment as they are; V^T's A fragments come
//     by ldmatrix.trans.
// paged_decode_tensor_cores (paged_decode_attention_plan.h) says which shapes run this loop.
// A stage of 8 tokens lies in one cache block (blocks are >= 8 tokens and every warp's first token
// is a multiple of 8), so one table entry addresses it, read one stage ahead of its copies.
// At head_dim 128 a lane's share of 8 tokens is 8 cp.async, 8 ldmatrix and 16 mma instructions,
// where the CUDA-core loop's lane runs 256 FMAs, 64 unpacks and the shuffles of its scores.
//
// kFp8 (an e4m3 cache, one fp32 scale for all of K and one for V): the stages hold the cache's
// bytes (half a 16-bit tile, so twice the stages keep as many bytes in flight), read by the same
// ldmatrix instructions as pairs of bytes and converted in registers, exactly (fp8_convert.cuh):
//   - K: a lane's register of matrix c is token g's dims 16c + 4t .. 16c + 4t + 3, two B pairs of
//     one k16 step (k slots 2t.. <- dims 4t, 4t + 1; slots 2t + 8.. <- dims 4t + 2, 4t + 3); Q's
//     A fragments are loaded in that k order;
//   - V: with .trans a lane's register holds dims 16c + 2g, 2g + 1 of tokens 2t, 2t + 1; its
//     strided pairs are the A fragment of one m16n8k8 tile whose row g is dim 16c + 2g and row
//     g + 8 dim 16c + 2g + 1 (O^T's rows in that order, put back when stored).
// A converted copy in shared memory instead (written, then read by the 16-bit code) tripled the
// shared-memory traffic a tile and ran at 69% of the copy bandwidth on W3's 16x4096 (H100). The
// scales are applied once: K's to the score scale, V's to the output at the end.
#pragma once
#include <cstdint>
#include <type_traits>

#include "kernels/fp8_convert.cuh"
#include "kernels/mma.cuh"
#include "kernels/paged_decode_attention.h"
#include "kernels/paged_decode_attention_common.cuh"

namespace pagedkv::kernels::decode {

constexpr int kStageTokens = 8;  // N of S's tile and K of O's: one ldmatrix row per token

// Stages of a warp's ring: 2 of 16-bit tiles; kFp8Stages (> 0: an fp8 cache) of fp8 ones.
template <int kFp8Stages>
constexpr int ring_stages() {
  return kFp8Stages > 0 ? kFp8Stages : 2;
}

// Shared memory of the rings of a CTA of W warps: [warp][stage][K, V][token][D] cache elements.
template <typename T, int D, int W, int kFp8Stages = 0>
constexpr int ring_bytes() {
  return W * ring_stages<kFp8Stages>() * 2 * kStageTokens * D * (kFp8Stages > 0 ? 1 : static_cast<int>(sizeof(T)));
}

// Element offset of 16-byte chunk `chunk` of token `token` (< 8) in a K or V tile of cache
// elements C. The chunk index is XOR-ed with the token, so an ldmatrix's 8 rows (8 tokens, one
// chunk) fall in 8 different 16-byte bank groups, and so do a copy's 8 consecutive lanes (one
// token, 8 chunks). A row of fewer than 8 chunks (fp8 at D = 64: 4) shares a 128-byte line with
// the next token's, so the XOR takes token / 2 there.
template <int D, typename C>
__device__ __forceinline__ int tile_offset(int token, int chunk) {
  constexpr int kRowChunks = D * static_cast<int>(sizeof(C)) / 16;
  constexpr int kTokensALine = kRowChunks >= 8 ? 1 : 8 / kRowChunks;
  return token * D + (chunk ^ (token / kTokensALine)) * (16 / static_cast<int>(sizeof(C)));
}

// One warp's share of the split [begin, end) in a CTA of W warps: its tokens begin + 8 * warp +
// 8 * W * i (begin a multiple of 8; tokens before `lo`, a sliding window's first key, weigh 0). Leaves the warp's normalized-later partial output, max and sum (log2 units) of its
// heads in s_acc, s_max and s_sum (a warp that saw no token leaves max kNegBig and sum 0).
// `ring_smem` is ring_bytes of shared memory that s_acc may alias: the CTA syncs before the first
// write to s_acc. `first_block` is the table entry of the warp's first tile (token begin +
// 8 * warp), read by the caller before the context length arrives.
template <typename T, int D, int G, int W, int kFp8Stages = 0>
__device__ __forceinline__ void mma_warp_loop(const PagedDecodeArgs& a, int block_shift, int b,
                                              int kv_head, int head0, int heads, int begin,
                                              int lo, int end, int first_block,
                                              unsigned char* ring_smem,
                                              float (*s_acc)[G][D], float (*s_max)[G],
                                              float (*s_sum)[G]) {
  static_assert(G <= 8, "a head group is N = 8 columns of O's tile");
  constexpr bool kFp8 = kFp8Stages > 0;
  using C = std::conditional_t<kFp8, uint8_t, T>;         // a cache element
  constexpr int kStages = ring_stages<kFp8Stages>();
  constexpr int kCacheChunks = D * sizeof(C) / 16;        // 16-byte chunks of a cached token row
  constexpr int kSteps = D / 16;                          // k16 steps of S, m16 tiles of O
  constexpr int kPieces = kStageTokens * kCacheChunks / 32;  // a lane's copies per tile
  constexpr int kTile = kStageTokens * D;                 // elements of a K or V tile
  constexpr int kWarpStride = W * kStageTokens;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  C* ring = reinterpret_cast<C*>(ring_smem + warp * (ring_bytes<T, D, W, kFp8Stages>() / W));

  // Q's A fragments, rows g (head g of the chunk; zeros past `heads`): [k step][cols 2t.., 2t+8..].
  uint32_t qa[kSteps][2];
  const T* q = static_cast<const T*>(a.q) + b * a.q_stride_row + (head0 + g) * a.q_stride_h;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {  // kFp8: dims 4t, 4t + 1 and 4t + 2, 4t + 3 (see above)
    const int first = kFp8 ? 4 * t : 2 * t, second = kFp8 ? 4 * t + 2 : 2 * t + 8;
    qa[s][0] = g < heads ? *reinterpret_cast<const uint32_t*>(q + 16 * s + first) : 0u;
    qa[s][1] = g < heads ? *reinterpret_cast<const uint32_t*>(q + 16 * s + second) : 0u;
  }

  // O^T's accumulators: [m tile s][c0..c3] = O[heads 2t, 2t + 1][dims 16s + g, 16s + 8 + g]
  // (kFp8: dims 16s + 2g, 16s + 2g + 1).
  float acc[kSteps][4];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[s][e] = 0.f;
  }
  // scores in log2 units (and K's fp8 scale: S is Q times K's stored values)
  const float q_scale = a.scale * kLog2e * (kFp8 ? *a.k_scale : 1.f);
  float m = kNegBig, l = 0.f;  // head g's running max and this lane's share of its sum

  const C* k_cache = static_cast<const C*>(a.k_cache);
  const C* v_cache = static_cast<const C*>(a.v_cache);
  const int* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks;
  const int64_t head_offset = kv_head * a.cache_stride_head;
  const int slot_mask = (1 << block_shift) - 1;

  // The stage to fill next: its first token and physical block (read one stage ahead).
  int next = begin + warp * kStageTokens;
  int next_block = next < end ? first_block : 0;
  auto fill_next = [&](int stage) {
    if (next < end) {
      C* k_dst = ring + stage * 2 * kTile;
      C* v_dst = k_dst + kTile;
      const int64_t block = next_block * a.cache_stride_block + head_offset;
#pragma unroll
      for (int r = 0; r < kPieces; ++r) {
        const int piece = lane + 32 * r;
        const int token = piece / kCacheChunks, chunk = piece % kCacheChunks;
        // Past the end: the last token again (same block), its weight is 0 below.
        const int slot = (min(next + token, end - 1)) & slot_mask;
        const int64_t src = block + slot * a.cache_stride_token + chunk * (16 / sizeof(C));
        cp_async16_stream(k_dst + tile_offset<D, C>(token, chunk), k_cache + src);
        cp_async16_stream(v_dst + tile_offset<D, C>(token, chunk), v_cache + src);
      }
    }
    cp_async_commit();  // possibly empty: the group count stays uniform
    next += kWarpStride;
    next_block = next < end ? __ldg(table + (next >> block_shift)) : 0;
  };
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) fill_next(stage);

  // ldmatrix rows: lanes 8i..8i+7 give tokens 0-7 of chunk 4j + i (matrix i of load j).
  const int frag_token = lane % 8, frag_chunk = lane / 8;
  int stage = 0;
  for (int t0 = begin + warp * kStageTokens; t0 < end; t0 += kWarpStride) {  // warp-uniform
    __syncwarp();  // every lane is done reading the stage refilled next
    fill_next((stage + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();
    __syncwarp();  // every lane's copies into this stage have landed
    const C* k_tile = ring + stage * 2 * kTile;
    const C* v_tile = k_tile + kTile;

    // S: head g, tokens 2t, 2t + 1 (c2, c3: empty rows). Odd k steps go to c_odd: two chains
    // of D / 32 dependent mma each instead of one of D / 16, to shorten the wait for S.
    float c[4] = {0.f, 0.f, 0.f, 0.f}, c_odd[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (kFp8) {  // an ldmatrix.x4 is 4 chunks of 16 dims: 4 k steps
#pragma unroll
      for (int j = 0; j < kSteps / 4; ++j) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_tile + tile_offset<D, C>(frag_token, 4 * j + frag_chunk));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint2 b = e4m3x4_to<T>(kb[i]);
          const uint32_t a4[4] = {qa[4 * j + i][0], 0u, qa[4 * j + i][1], 0u};
          mma16816(i % 2 == 0 ? c : c_odd, a4, b.x, b.y, T{});
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kSteps / 2; ++j) {
        uint32_t kb[4];
        ldmatrix_x4(kb, k_tile + tile_offset<D, C>(frag_token, 4 * j + frag_chunk));
        const uint32_t a0[4] = {qa[2 * j][0], 0u, qa[2 * j][1], 0u};
        const uint32_t a1[4] = {qa[2 * j + 1][0], 0u, qa[2 * j + 1][1], 0u};
        mma16816(c, a0, kb[0], kb[1], T{});
        mma16816(c_odd, a1, kb[2], kb[3], T{});
      }
    }
    c[0] += c_odd[0];
    c[1] += c_odd[1];

    // Online softmax in log2 units, with the CUDA-core loop's lazy rescale (the max moves only
    // when a score passes it by more than kRescaleSlack).
    const int tok = t0 + 2 * t;
    const bool valid0 = tok < end && tok >= lo, valid1 = tok + 1 < end && tok + 1 >= lo;
    float x0 = c[0] * q_scale, x1 = c[1] * q_scale;
    if (a.logit_softcap > 0.f) {  // uniform; read from the parameters, no registers held
      x0 = softcap_log2<T>(x0, a.logit_softcap * kLog2e);
      x1 = softcap_log2<T>(x1, a.logit_softcap * kLog2e);
    }
    x0 = valid0 ? x0 : kNegBig;
    x1 = valid1 ? x1 : kNegBig;
    float tile_max = fmaxf(x0, x1);
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    if (__any_sync(0xffffffffu, tile_max > m + kRescaleSlack)) {
      const float new_max = fmaxf(m, tile_max);
      const float alpha = fast_exp2(m - new_max);
      m = new_max;
      l *= alpha;
      // O's columns are heads 2t and 2t + 1: their factors from the quads of those heads.
      const float alpha_lo = __shfl_sync(0xffffffffu, alpha, 8 * t);
      const float alpha_hi = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        acc[s][0] *= alpha_lo;
        acc[s][1] *= alpha_hi;
        acc[s][2] *= alpha_lo;
        acc[s][3] *= alpha_hi;
      }
    }
    const uint32_t p = pack2(valid0 ? fast_exp2(x0 - m) : 0.f, valid1 ? fast_exp2(x1 - m) : 0.f, T{});
    l += unpack2_sum(p, T{});  // the rounded weights O is summed with

    if constexpr (kFp8) {
#pragma unroll
      for (int j = 0; j < kSteps / 4; ++j) {
        uint32_t va[4];
        ldmatrix_x4_trans(va, v_tile + tile_offset<D, C>(frag_token, 4 * j + frag_chunk));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint2 rows = e4m3x4_to<T, true>(va[i]);  // dims 2g, 2g + 1 of tokens 2t, 2t + 1
          mma1688(acc[4 * j + i], rows.x, rows.y, p, T{});
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kSteps / 2; ++j) {
        uint32_t va[4];
        ldmatrix_x4_trans(va, v_tile + tile_offset<D, C>(frag_token, 4 * j + frag_chunk));
        mma1688(acc[2 * j], va[0], va[1], p, T{});
        mma1688(acc[2 * j + 1], va[2], va[3], p, T{});
      }
    }
    stage = (stage + 1) % kStages;
  }
  cp_async_wait<0>();

  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if constexpr (kFp8) {  // O was summed over V's stored values
    const float v_scale = *a.v_scale;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[s][e] *= v_scale;
    }
  }
  __syncthreads();  // every warp is done with its ring: s_acc may alias it
  // The dims of O^T's rows g and g + 8 in tile s (kFp8: 2g and 2g + 1).
  const int dim_lo = kFp8 ? 2 * g : g, dim_hi = kFp8 ? 2 * g + 1 : g + 8;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (2 * t < G) {
      s_acc[warp][2 * t][16 * s + dim_lo] = acc[s][0];
      s_acc[warp][2 * t][16 * s + dim_hi] = acc[s][2];
    }
    if (2 * t + 1 < G) {
      s_acc[warp][2 * t + 1][16 * s + dim_lo] = acc[s][1];
      s_acc[warp][2 * t + 1][16 * s + dim_hi] = acc[s][3];
    }
  }
  if (t == 0 && g < G) {
    s_max[warp][g] = m;
    s_sum[warp][g] = l;
  }
}

}  // namespace pagedkv::kernels::decode
