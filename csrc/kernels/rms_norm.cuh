// The second half of every RMSNorm kernel (rms_norm.cu, peer_all_reduce.cu), after the block has
// the row's inverse RMS: HF's LlamaRMSNorm rounding, normalise in fp32, round to T, multiply by
// the weight, round again; with kGemma HF's GemmaRMSNorm: normalised * (1 + weight) in fp32,
// rounded once.
#pragma once
#include "kernels/common.cuh"

namespace pagedkv::kernels {

// out_row [num_vecs], row [num_vecs], weight [num_vecs] of kVec elements; this thread's vectors
// (threadIdx.x, strided by blockDim.x). out_row may alias row.
template <typename T, int kVec, bool kGemma = false>
__device__ __forceinline__ void write_normalized_row(Vec<T, kVec>* out_row, const Vec<T, kVec>* row,
                                                     const Vec<T, kVec>* weight, int num_vecs,
                                                     float inv_rms) {
  for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    const Vec<T, kVec> x = row[i];
    const Vec<T, kVec> g = weight[i];
    Vec<T, kVec> y;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if constexpr (kGemma) {
        y.v[j] = from_float<T>(to_float(x.v[j]) * inv_rms * (1.f + to_float(g.v[j])));
      } else {
        const T normed = from_float<T>(to_float(x.v[j]) * inv_rms);
        y.v[j] = from_float<T>(to_float(g.v[j]) * to_float(normed));
      }
    }
    out_row[i] = y;
  }
}

}  // namespace pagedkv::kernels
