// The second launch of a split paged prefill: one CTA per query tile (one split's grid, the same
// tiles as the split CTAs'), whose threads merge each row's partials of the splits that hold
// keys of its tile (max and sum in log2 units, as the split CTAs left them) into the output.
#pragma once
#include "kernels/paged_prefill_attention_common.cuh"

namespace pagedkv::kernels::prefill {

constexpr int kMergeThreads = 256;

// plan: the split launch's plan (splits > 1).
template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads) paged_prefill_merge_kernel(const PagedPrefillArgs a,
                                                                            const Plan plan) {
  Plan whole = plan;  // the tile's whole key range, not one split's
  whole.splits = 1;
  Work w;
  if (!cta_work(a, whole, w)) return;
  // Splits s with keys in [key_lo, kv_end) (key_lo: the sliding window's first key of the tile,
  // else 0); a row before position 0 has none and gets zeros.
  const int first = w.key_lo / plan.keys_per_split;
  const int active = (w.kv_end + plan.keys_per_split - 1) / plan.keys_per_split;
  for (int i = threadIdx.x; i < w.rows * (D / 4); i += kMergeThreads) {
    const int r = i / (D / 4), d = (i % (D / 4)) * 4;
    float max_all = kNegBig, sum = 0.f;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = first; s < active; ++s) {
      const SplitRow part = split_row(a, plan, w, r, s);
      const float2 st = *part.stats;
      const float4 x = *reinterpret_cast<const float4*>(part.out + d);
      const float new_max = fmaxf(max_all, st.x);
      const float rescale = exp2f(max_all - new_max);
      const float weight = exp2f(st.x - new_max);  // 0 for a split of no visible key (kNegBig)
      sum = sum * rescale + weight * st.y;
      o[0] = o[0] * rescale + weight * x.x;
      o[1] = o[1] * rescale + weight * x.y;
      o[2] = o[2] * rescale + weight * x.z;
      o[3] = o[3] * rescale + weight * x.w;
      max_all = new_max;
    }
    const float inv = a.sinks != nullptr ? inv_sum_with_sink(max_all, sum, a.sinks[w.head0 + r % w.heads])
                                         : sum > 0.f ? 1.f / sum : 0.f;
    Vec<T, 4> v;
#pragma unroll
    for (int j = 0; j < 4; ++j) v.v[j] = from_float<T>(o[j] * inv);
    *reinterpret_cast<Vec<T, 4>*>(output_row<T>(a, w, r) + d) = v;
  }
}

}  // namespace pagedkv::kernels::prefill
