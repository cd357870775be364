// The end of the split-k tensor-core GEMVs (gemv_4bit_mma.cu, gemv_fp8_mma.cu): each of a CTA's
// kSplit warps holds an m16n8k16 C fragment of the same 16-row tile over its share of k; they are
// summed through shared memory and warp 0 stores the tile's outputs.
#pragma once
#include <cstdint>

#include "kernels/common.cuh"

namespace pagedkv::kernels {

// c: this lane's C fragment (c[2h + e] = out^T[16 tile + lane / 4 + 8h][2 (lane % 4) + e]);
// partial: shared [kSplit - 1][4][32]; out [m, n]. Every thread of the CTA calls it.
template <typename T, int kSplit>
__device__ __forceinline__ void store_split_k_tile(float (&c)[4], float (*partial)[4][32], T* out,
                                                   int tile, int m, int n) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (warp > 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp - 1][i][lane] = c[i];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int w = 0; w < kSplit - 1; ++w)
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] += partial[w][i][lane];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int col = tile * 16 + lane / 4 + 8 * h;  // the output column
    if (col >= n) continue;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 2 * (lane % 4) + e;  // the x row
      if (i < m) out[static_cast<int64_t>(i) * n + col] = from_float<T>(c[2 * h + e]);
    }
  }
}

}  // namespace pagedkv::kernels
