// Attention sinks (GPT-OSS): one logit per query head that joins a row's softmax with a zero
// value row. The kernels run their softmax without it and fold it in once, where a row's output
// is normalized: HF takes the max over the scores and the sink together, so the fold rescales to
// that max rather than adding exp(sink - max) (which could overflow past a large sink).
#pragma once

namespace pagedkv::kernels {

// The factor that turns a row's unnormalized output into its normalized one, given the row's
// max and sum of exp2(score - max) (log2 units: scores scaled by log2(e)) and its sink logit
// in natural units; 0 for a row of no key (sum 0: a padding row gets zeros).
__device__ __forceinline__ float inv_sum_with_sink(float max, float sum, float sink) {
  if (!(sum > 0.f)) return 0.f;
  const float sink_log2 = sink * 1.4426950408889634f;
  const float joint = fmaxf(max, sink_log2);
  const float rescale = exp2f(max - joint);
  return rescale / fmaf(sum, rescale, exp2f(sink_log2 - joint));
}

}  // namespace pagedkv::kernels
