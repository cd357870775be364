// RMSNorm and residual-add + RMSNorm: one thread block per row, fp32 accumulation, 16-byte
// accesses when the row allows. Rounding follows HF's LlamaRMSNorm so greedy tokens match:
// normalize in fp32, round to T, multiply by the weight, round again. The residual sum is rounded
// to T before it is squared, as HF adds the residual in the model's dtype. kGemma: GemmaRMSNorm's
// rounding instead (kernels/rms_norm.cuh).
#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/rms_norm.cuh"
#include "kernels/rms_norm.h"

namespace pagedkv::kernels {
namespace {

// out [rows, hidden], residual [rows, hidden] (only if kAddResidual), input [rows, hidden],
// weight [hidden]. For the fused op out == input: no __restrict__ on those two.
template <typename T, int kVec, bool kAddResidual, bool kGemma>
__global__ void rms_norm_kernel(T* out, T* residual, const T* input,
                                const T* __restrict__ weight, int hidden, float epsilon) {
  begin_dependent_kernel();
  using V = Vec<T, kVec>;
  const int num_vecs = hidden / kVec;
  const int64_t row_offset = static_cast<int64_t>(blockIdx.x) * hidden;
  const V* in_row = reinterpret_cast<const V*>(input + row_offset);
  V* res_row = reinterpret_cast<V*>(residual + (kAddResidual ? row_offset : 0));

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    V x = in_row[i];
    if constexpr (kAddResidual) {
      const V r = res_row[i];
#pragma unroll
      for (int j = 0; j < kVec; ++j) x.v[j] = from_float<T>(to_float(x.v[j]) + to_float(r.v[j]));
      res_row[i] = x;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float v = to_float(x.v[j]);
      sum_sq += v * v;
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + epsilon);

  // Each thread re-reads exactly the elements it wrote above, so no barrier is needed.
  const V* src_row = kAddResidual ? res_row : in_row;
  write_normalized_row<T, kVec, kGemma>(reinterpret_cast<V*>(out + row_offset), src_row,
                                reinterpret_cast<const V*>(weight), num_vecs, inv_rms);
}

template <bool kAddResidual, bool kGemma>
cudaError_t launch(void* out, void* residual, const void* input, const void* weight, int64_t rows,
                   int hidden, float epsilon, DType dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = hidden % kVec == 0 && aligned16(out) && aligned16(input) &&
                            aligned16(weight) && (!kAddResidual || aligned16(residual));
    const int per_thread = vectorized ? kVec : 1;
    const int threads = std::min(1024, std::max(32, (hidden / per_thread + 31) / 32 * 32));
    const dim3 grid(static_cast<unsigned>(rows));
    auto* o = static_cast<T*>(out);
    auto* r = static_cast<T*>(residual);
    auto* x = static_cast<const T*>(input);
    auto* w = static_cast<const T*>(weight);
    if (vectorized) {
      launch_dependent(rms_norm_kernel<T, kVec, kAddResidual, kGemma>, grid, threads, 0, stream, o, r, x, w, hidden, epsilon);
    } else {
      launch_dependent(rms_norm_kernel<T, 1, kAddResidual, kGemma>, grid, threads, 0, stream, o, r, x, w, hidden, epsilon);
    }
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t rms_norm(void* out, const void* input, const void* weight, int64_t rows, int hidden,
                     float epsilon, bool gemma_style, DType dtype, cudaStream_t stream) {
  if (gemma_style) {
    return launch<false, true>(out, nullptr, input, weight, rows, hidden, epsilon, dtype, stream);
  }
  return launch<false, false>(out, nullptr, input, weight, rows, hidden, epsilon, dtype, stream);
}

cudaError_t fused_add_rms_norm(void* input, void* residual, const void* weight, int64_t rows,
                               int hidden, float epsilon, bool gemma_style, DType dtype,
                               cudaStream_t stream) {
  if (gemma_style) {
    return launch<true, true>(input, residual, input, weight, rows, hidden, epsilon, dtype, stream);
  }
  return launch<true, false>(input, residual, input, weight, rows, hidden, epsilon, dtype, stream);
}

}  // namespace pagedkv::kernels
