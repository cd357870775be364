// Paged prefill attention: the host plan and the dispatch. One CTA per (sequence, kv head, head
// chunk, tile of query tokens) whose 64 rows are (token, query head) pairs of the kv head's group,
// so each K/V tile read into shared memory through the block table serves the whole group (GQA).
// The CTA walks the context's keys up to its last token's position with an fp32 online softmax.
// bf16/fp16 run on tensor cores (paged_prefill_attention_mma.cuh), fp32 on CUDA cores
// (paged_prefill_attention_simt.cuh). The grid follows the batch's tokens (flat tiles, see
// cta_work), and tiles are ordered latest first (they have the most keys), so the long CTAs start
// first. A batch of few new tokens over a long context gives few CTAs that each walk the whole
// context: there the keys of each 128-row CTA are split over several CTAs (args.num_splits, which
// the caller takes from paged_prefill_num_splits to size the workspace), whose partials a second
// launch merges (paged_prefill_attention_merge.cuh).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/paged_prefill_attention.h"
#include "kernels/paged_prefill_attention_common.cuh"
#include "kernels/paged_prefill_attention_merge.cuh"
#include "kernels/paged_prefill_attention_mma.cuh"
#include "kernels/paged_prefill_attention_simt.cuh"

namespace pagedkv::kernels {
namespace {

using prefill::Plan;

int log2_exact(int x) {
  int shift = 0;
  while ((1 << shift) < x) ++shift;
  return shift;
}

// Above 48 KB of dynamic shared memory a kernel must opt in (per device and function; not a
// stream operation, so allowed under graph capture).
template <typename Kernel>
cudaError_t launch_kernel(Kernel kernel, int threads, int smem, const PagedPrefillArgs& a,
                          const Plan& plan, int64_t ctas, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(ctas), threads, smem, stream>>>(a, plan);
  return cudaGetLastError();
}

// The plan of a kernel whose CTAs hold `rows` (token, query head) rows, unsplit; false where the
// grid would pass 2^31 - 1 CTAs.
bool make_plan(const PagedPrefillArgs& a, int rows, Plan& plan, int64_t& ctas) {
  const PrefillHeadGroups g = prefill_head_groups(a.num_q_heads, a.num_kv_heads);
  plan.group_size = g.group_size;
  plan.head_chunks = g.chunks;
  plan.chunk_heads = g.chunk_heads;
  plan.tokens_per_tile = rows / plan.chunk_heads;
  const int64_t tiles = prefill_tiles(a.num_tokens, a.batch, a.max_query_len, plan.tokens_per_tile);
  plan.block_shift = log2_exact(a.block_size);
  plan.max_tokens = a.max_blocks * a.block_size;
  plan.splits = 1;
  plan.keys_per_split = plan.max_tokens;
  ctas = tiles * a.num_kv_heads * plan.head_chunks;
  if (ctas > 0x7fffffff) return false;
  plan.tiles = static_cast<int>(tiles);  // <= ctas
  return true;
}

// kFp8: an e4m3 cache (16-bit q at head_dim 64, 128 or 256 only: paged_prefill_attention.cpp).
template <typename T, int D, bool kOptions, bool kFp8>
cudaError_t launch(const PagedPrefillArgs& a, cudaStream_t stream) {
  if (a.num_splits > 1 && !prefill_can_split(D, sizeof(T))) return cudaErrorInvalidValue;
  Plan plan;
  int64_t ctas = 0;
  if constexpr (sizeof(T) == 2) {
    // 128-row CTAs read each K/V tile for twice the rows, where the grid still gives every SM
    // its two CTAs; where it does not, split over the keys when the context is long enough
    // (1x512/8192: 2 splits of 128 rows ran 1.21x faster than 256 CTAs of 64, which ran 1.4x
    // faster than 128 unsplit CTAs of 128), else 64-row CTAs.
    if constexpr (D <= 128) {
      static_assert(prefill::mma::rows<2>() == kPrefillSplitRows &&
                    prefill::mma::keys<D>() % kPrefillSplitKeyTile == 0,
                    "paged_prefill_attention_plan.h's split shapes");
      if (!make_plan(a, prefill::mma::rows<2>(), plan, ctas)) return cudaErrorInvalidConfiguration;
      const auto kernel = prefill::paged_prefill_mma_kernel<T, D, 2, kOptions, kFp8>;
      constexpr int smem = prefill::mma::smem_bytes<T, D, 2, kFp8>();
      if (a.num_splits > 1) {
        if (a.workspace == nullptr) return cudaErrorInvalidValue;
        if (ctas * a.num_splits > 0x7fffffff) return cudaErrorInvalidConfiguration;
        plan.splits = a.num_splits;
        plan.keys_per_split =
            static_cast<int>(paged_prefill_keys_per_split(plan.max_tokens, a.num_splits));
        const cudaError_t err =
            launch_kernel(kernel, prefill::mma::kThreads, smem, a, plan, ctas * a.num_splits, stream);
        if (err != cudaSuccess) return err;
        return launch_kernel(prefill::paged_prefill_merge_kernel<T, D>, prefill::kMergeThreads, 0,
                             a, plan, ctas, stream);
      }
      if (ctas >= static_cast<int64_t>(prefill::mma::kCtasPerSm) * a.num_sms) {
        return launch_kernel(kernel, prefill::mma::kThreads, smem, a, plan, ctas, stream);
      }
    }
    if (!make_plan(a, prefill::mma::rows<1>(), plan, ctas)) return cudaErrorInvalidConfiguration;
    return launch_kernel(prefill::paged_prefill_mma_kernel<T, D, 1, kOptions, kFp8>, prefill::mma::kThreads,
                         prefill::mma::smem_bytes<T, D, 1, kFp8>(), a, plan, ctas, stream);
  } else {
    if (!make_plan(a, prefill::simt::kRows, plan, ctas)) return cudaErrorInvalidConfiguration;
    return launch_kernel(prefill::paged_prefill_simt_kernel<T, D>, prefill::simt::kThreads,
                         prefill::simt::smem_bytes<T, D>(), a, plan, ctas, stream);
  }
}

}  // namespace

cudaError_t paged_prefill_attention(const PagedPrefillArgs& a, DType dtype, cudaStream_t stream) {
  if (a.batch == 0 || a.num_q_heads == 0 || a.num_tokens == 0 || a.max_query_len == 0) {
    return cudaSuccess;
  }
  if (a.max_query_len < 0 || a.max_blocks < 1 || a.num_kv_heads < 1 ||
      a.num_q_heads % a.num_kv_heads != 0 || a.num_splits < 1) {
    return cudaErrorInvalidValue;
  }
  const bool options = a.sliding_window > 0 || a.logit_softcap > 0.f;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto with_options, auto fp8) -> cudaError_t {
      constexpr bool kOptions = decltype(with_options)::value, kFp8 = decltype(fp8)::value;
      if constexpr (kFp8) {  // 16-bit q at head_dim 64, 128, 256 (paged_prefill_attention.cpp)
        if constexpr (sizeof(T) != 2) {
          return cudaErrorInvalidValue;
        } else {
          switch (a.head_dim) {
            case 64: return launch<T, 64, kOptions, true>(a, stream);
            case 128: return launch<T, 128, kOptions, true>(a, stream);
            case 256: return launch<T, 256, kOptions, true>(a, stream);
            default: return cudaErrorInvalidValue;
          }
        }
      } else {
        switch (a.head_dim) {
          case 64: return launch<T, 64, kOptions, false>(a, stream);
          case 80: return launch<T, 80, kOptions, false>(a, stream);
          case 96: return launch<T, 96, kOptions, false>(a, stream);
          case 128: return launch<T, 128, kOptions, false>(a, stream);
          case 256: return launch<T, 256, kOptions, false>(a, stream);
          default: return cudaErrorInvalidValue;
        }
      }
    };
    if (a.k_scale != nullptr) {
      return options ? run(std::true_type{}, std::true_type{}) : run(std::false_type{}, std::true_type{});
    }
    return options ? run(std::true_type{}, std::false_type{}) : run(std::false_type{}, std::false_type{});
  });
}

}  // namespace pagedkv::kernels
