// Paged decode attention. One thread block (CTA) per (sequence, kv head, split, head chunk); it
// serves all query heads of that kv head (GQA: each K/V row is read once for the whole group).
// Inside a CTA, 4 warps (8 on tensor cores for a grid of at most one CTA per SM, unsplit or in
// splits of >= 512 tokens: paged_decode_warps) take turns over the split's tokens, each with its
// own fp32 online softmax (max, sum, output), merged through shared memory at the end. Two main
// loops:
//   - tensor cores (paged_decode_attention_mma.cuh; bf16/fp16 at head_dim 64, 128 and 256, so W1 and
//     W3):
//     per warp a 2-stage cp.async ring of 8-token K/V tiles, scores and the weighted sum as
//     mma.sync tiles (at most 125 registers, 4 CTAs of 4 warps per SM; 2 at head_dim 256);
//   - CUDA cores (paged_decode_attention_simt.cuh; fp32, and 16-bit at head_dim 80 and 96): lanes share a
//     token row with 16-byte loads, several tokens side by side, merged by shuffles.
// Scores are kept in log2 units (the query is pre-scaled by scale * log2(e)), so exp2 suffices.
// A sliding window (args.sliding_window) starts each sequence at its first key: the splits before
// it read nothing and are left out of the merge; a logit softcap is a uniform branch on the
// scores. Neither costs the default path (0, 0) more than a compare per token.
//
// With num_splits > 1 each CTA of a sequence that spans several splits writes its normalized
// partial output and (max, sum) to the workspace, and the last CTA of the sequence's head chunk
// to finish (an atomic counter in the workspace) merges them: one launch in all, where a second
// combine kernel cost ~1 us per call at small batch.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/attention_sink.cuh"
#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/paged_decode_attention.h"
#include "kernels/paged_decode_attention_common.cuh"
#include "kernels/paged_decode_attention_mma.cuh"
#include "kernels/paged_decode_attention_simt.cuh"

namespace pagedkv::kernels {
namespace {

using namespace decode;

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

// Dynamic shared memory of paged_decode_kernel with W warps: the merge's [W][G][D] partial
// outputs; with kMma, at least the main loop's rings (the same bytes). Dynamic, since the wide
// CTA's 64 KB of rings pass the 48 KB static limit.
template <typename T, int D, int G, bool kMma, int W, int kFp8Stages>
constexpr int smem_bytes() {
  constexpr int merge = W * G * D * static_cast<int>(sizeof(float));
  return kMma ? std::max(merge, ring_bytes<T, D, W, kFp8Stages>()) : merge;
}

// kMma: the tensor-core main loop (paged_decode_attention_mma.cuh) instead of the CUDA-core one
// above.
// W: warps per CTA, kWarps or (tensor cores only) 8 (paged_decode_warps); the launch bounds keep
// the registers of kWarps-warp CTAs at the same warps per SM.
// kFp8Stages > 0: an e4m3 cache with a.k_scale / a.v_scale (tensor cores only), staged in that
// many stages a warp.
template <typename T, int D, int G, bool kMma, int W, int kFp8Stages>
__global__ void __launch_bounds__(W * 32, paged_ctas_per_sm(G, kMma, D) * kWarps / W)
paged_decode_kernel(const PagedDecodeArgs a, const Plan plan) {
  begin_dependent_kernel();
  static_assert(W == kWarps || kMma, "the CUDA-core loop runs kWarps warps");
  static_assert(kFp8Stages == 0 || kMma, "the fp8 cache runs the tensor-core loop");
  constexpr int kThreads = W * 32;
  // blockIdx.x = ((b * num_kv_heads + kv_head) * num_splits + split) * head_chunks + chunk:
  // the CTAs that read the same K/V rows are neighbours (L2 serves the other head chunks).
  int idx = blockIdx.x;
  const int chunk = idx % plan.head_chunks;
  idx /= plan.head_chunks;
  const int split = idx % a.num_splits;
  idx /= a.num_splits;
  const int kv_head = idx % a.num_kv_heads;
  const int b = a.row_order != nullptr ? __ldg(a.row_order + idx / a.num_kv_heads) : idx / a.num_kv_heads;

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
  // A sliding window's first key (0 without one) and the first split holding it: the splits
  // before it read nothing and are not merged. The CUDA-core loop starts at the key; the
  // tensor-core loop at the start of its block (a stage of 8 tokens lies in one block), the keys
  // before it weighing 0.
  const int lo = window_first_key(ctx, a.sliding_window);
  const int first_split = lo / plan.tokens_per_split;
  const int start = max(begin, kMma ? (lo >> plan.block_shift) << plan.block_shift : lo);
  const int head0 = kv_head * plan.group_size + chunk * plan.chunk_heads;  // first query head
  const int heads = min(plan.chunk_heads, plan.group_size - chunk * plan.chunk_heads);

  T* out = static_cast<T*>(a.out) + b * a.out_stride_row + head0 * a.out_stride_h;
  if (start >= end) {
    // Nothing to read. Split 0 of a padding row (context 0) writes its zeros; other splits past
    // the context, or before the window, are not counted by the merge below.
    if (split == 0 && ctx == 0) {
      const float zero[4] = {0.f, 0.f, 0.f, 0.f};
      for (int i = threadIdx.x; i < heads * (D / 4); i += kThreads) {
        store4(out + (i / (D / 4)) * a.out_stride_h + (i % (D / 4)) * 4, zero);
      }
    }
    return;
  }

  // The warps' partial outputs, maxima and sums, merged below. With kMma the partial outputs
  // take the bytes of the main loop's rings (written after it).
  // smem_bytes<T, D, G, kMma, W, kFp8Stages>(). 128-byte aligned: placed after the static arrays at a 16-byte
  // boundary, the rings' swizzled tiles straddle 128-byte lines, and the tensor-core loop ran
  // 7-12% slower on an H100 (sessions 9-10; as fast as static memory when aligned).
  extern __shared__ __align__(128) unsigned char smem[];
  float (*s_acc)[G][D] = reinterpret_cast<float (*)[G][D]>(smem);
  __shared__ float s_max[W][G];
  __shared__ float s_sum[W][G];
  if constexpr (kMma) {
    if (start != begin) {  // a window moved the split's start: the warp's first tile moved too
      const int first = start + (threadIdx.x / 32) * kStageTokens;
      first_block = first < end ? __ldg(a.block_tables + static_cast<int64_t>(b) * a.max_blocks +
                                        (first >> plan.block_shift))
                                : 0;
    }
    mma_warp_loop<T, D, G, W, kFp8Stages>(a, plan.block_shift, b, kv_head, head0, heads, start, lo, end,
                              first_block, smem, s_acc, s_max, s_sum);
  } else {
    simt_warp_loop<T, D, G>(a, plan.block_shift, b, kv_head, head0, heads, start, end, s_acc,
                            s_max, s_sum);
  }
  __syncthreads();

  // Splits holding part of this sequence's context (in its window): first_split .. end_split - 1.
  // With one, the CTA has the whole softmax and writes the output directly (short contexts of a
  // split bucket skip the workspace).
  const int end_split = (ctx + plan.tokens_per_split - 1) / plan.tokens_per_split;
  const int active = end_split - first_split;
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
    // sum >= 1: the split holds at least one token of the window. A sink is folded in once: here
    // when this CTA has the whole softmax, else by the merge below.
    const float inv = active == 1 && a.sinks != nullptr ? inv_sum_with_sink(max_all, sum, a.sinks[head0 + h])
                                                        : 1.f / sum;
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
    for (int sp = first_split; sp < end_split; ++sp) {
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
    // sum >= 1: the split holding the max adds >= 1
    const float inv = a.sinks != nullptr ? inv_sum_with_sink(max_all, sum, a.sinks[head0 + h]) : 1.f / sum;
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

template <typename T, int D, int G, int W, int kFp8Stages>
cudaError_t launch_warps(const PagedDecodeArgs& a, const Plan& plan, int64_t ctas,
                         cudaStream_t stream) {
  constexpr bool kMma = paged_decode_tensor_cores(D, sizeof(T));
  constexpr int smem = smem_bytes<T, D, G, kMma, W, kFp8Stages>();
  const auto kernel = paged_decode_kernel<T, D, G, kMma, W, kFp8Stages>;
  // The opt-in past 48 KB (which counts the static merge arrays too: 4 KB is more than they
  // take), per device: set at every launch.
  if constexpr (smem + 4096 > 48 * 1024) {
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
    if (a.k_scale != nullptr) {  // fp8: 4 stages (8 measured slower: fewer CTAs fit, session 32)
      if (warps == 8) return launch_warps<T, D, G, 8, 4>(a, plan, ctas, stream);
      return launch_warps<T, D, G, kWarps, 4>(a, plan, ctas, stream);
    }
    if (warps == 8) return launch_warps<T, D, G, 8, 0>(a, plan, ctas, stream);
  } else {
    if (a.k_scale != nullptr) return cudaErrorInvalidValue;  // the fp8 cache: tensor cores only
  }
  return launch_warps<T, D, G, kWarps, 0>(a, plan, ctas, stream);
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
  const int warps = paged_decode_warps(a.num_splits, ctas, a.num_sms, plan.tokens_per_split, a.head_dim);

  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (a.head_dim) {
      case 64: return launch<T, 64>(a, plan, g.padded, warps, ctas, stream);
      case 80: return launch<T, 80>(a, plan, g.padded, warps, ctas, stream);
      case 96: return launch<T, 96>(a, plan, g.padded, warps, ctas, stream);
      case 128: return launch<T, 128>(a, plan, g.padded, warps, ctas, stream);
      case 256: return launch<T, 256>(a, plan, g.padded, warps, ctas, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace pagedkv::kernels
