// Torch-free constants shared by the weight-streaming GEMVs of the quantized formats (int4
// gemv_w4a16, fp8 gemv_fp8, nf4 gemv_nf4; their skeleton is kernels/gemv_dequant.cuh).
#pragma once

namespace pagedkv::kernels {

// Largest number of rows of x a quantized GEMV takes; the launchers send more rows (and fp32 x)
// to a dequantized copy of the weight and cuBLAS (cuda/linear_dequant.h).
constexpr int kGemvDequantMaxRows = 8;

}  // namespace pagedkv::kernels
