// Torch-free launchers of the skinny matrix product used by decode steps: out = x @ weight^T
// (+ bias), or a gated MLP's act(x @ gate^T) * (x @ up^T), for a few rows of x, reading the
// weight once at close to memory bandwidth.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/gated_act.h"

namespace pagedkv::kernels {

// Largest number of rows of x the CUDA-core kernel (gemv) handles. Measured on an H100
// (lab/measurements.md): 1-2 rows beat cuBLAS by 4-9%, 4 rows tie, 8 rows lose 19%.
constexpr int kGemvMaxRows = 2;
// Largest number of rows of the tensor-core kernel (gemv_mma: one m16n8k16 n-tile up to 8 rows,
// two up to 16); the launcher sends kGemvMaxRows + 1 .. kGemvMmaMaxRows rows there and more rows
// to cuBLAS. Measured on an H100: level with cuBLAS at 4 and 8 rows (0.93-1.02 per matrix).
constexpr int kGemvMmaMaxRows = 16;
// Past one n-tile (9-16 rows: speculative verification steps) the tensor-core kernel wins only
// where a matrix is small enough for the fixed cost of a launch to dominate: SmolLM2-135M's
// 0.7-3.5 MB matrices (prompt lookup at k 10, 12 rows a round: 1.79x -> 1.99x pagedkv without
// it, H200). On W1's 25-271 MB matrices cuBLAS is 0-22% faster at 12-16 rows (H200,
// bench_linear.py --rows 8,12,16): matrices of kGemvMmaWideBytes and more keep cuBLAS there
// (W2's steps of 9-16 rows too: its smallest matrix is 4 MiB).
constexpr int64_t kGemvMmaWideBytes = int64_t{4} << 20;
constexpr int kGemvMmaTileRows = 8;  // rows of one n-tile

// On CUDA cores, m <= kGemvMaxRows. act kNone: out: [m, n] = x @ weight^T + bias, where x: [m, k]
// (row stride x_stride elements), weight: [n, k] contiguous, bias: [n] or nullptr.
// act kSilu / kGeluTanh: out: [m, n] = act(x @ gate^T) * (x @ up^T), where weight: [2n, k] holds
// the gate rows then the up rows (HF's MLP with fused gate/up weights, HF's rounding), bias
// nullptr. k % 8 == 0 and all pointers 16-byte aligned (the launcher checks).
cudaError_t gemv(void* out, const void* x, int64_t x_stride, const void* weight, const void* bias,
                 int m, int n, int k, GatedAct act, DType dtype, cudaStream_t stream);

// gemv on tensor cores for m <= kGemvMmaMaxRows (csrc/kernels/gemv_mma.cu). Same arguments and
// conditions as gemv.
cudaError_t gemv_mma(void* out, const void* x, int64_t x_stride, const void* weight,
                     const void* bias, int m, int n, int k, GatedAct act, DType dtype,
                     cudaStream_t stream);

}  // namespace pagedkv::kernels
