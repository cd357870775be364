// FP8 (e4m3) weight skinny GEMM on tensor cores for 3..8 rows of x (kernels/gemv_byte_mma.cuh),
// W = e4m3 values times an fp32 scale per (block_n x block_k) block. The e4m3 values convert
// exactly to x's 16-bit type (one cvt to fp16 pairs; bf16 x takes two more, through fp32). Each
// 64-k step of a warp lies in one k-block (block_k % 64 == 0, or one block over all of k).
#include <cstdint>
#include <type_traits>

#include <cuda_fp8.h>

#include "kernels/gemv_4bit_mma.h"  // quant_mma_enabled
#include "kernels/gemv_byte_mma.cuh"
#include "kernels/gemv_fp8.h"

namespace pagedkv::kernels {
namespace {

struct Fp8Blocks {
  const float* scales;  // [ceil(n / block_n), scale_cols]
  int block_n;
  int block_k;
  int scale_cols;  // ceil(k / block_k)

  // Two e4m3 values (low byte first) -> the register of two T values (exact: e4m3 fits both).
  template <typename T>
  __device__ __forceinline__ static uint32_t pair_to(uint32_t two) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
    uint32_t bits;
    if constexpr (std::is_same_v<T, __half>) {
      memcpy(&bits, &h, 4);
    } else {
      const float2 f = __half22float2(__half2(h));
      bits = pack2(f.x, f.y, T{});
    }
    return bits;
  }

  __device__ __forceinline__ const float* row_scales(int row) const {
    return scales + static_cast<int64_t>(row / block_n) * scale_cols;
  }

  __device__ __forceinline__ float step_scale(const float* row, int step, int k) const {
    return __ldg(row + min(step * gemv_byte_mma::kStepK, k - 1) / block_k);  // the step's k-block
  }
};

}  // namespace

bool gemv_fp8_mma_takes(int m, int k, int block_n, int block_k) {
  // 1-2 rows stay on the CUDA-core kernel: measured faster there on the W1 shape (H100: batch 1
  // 3.34 ms a step against 3.80 on tensor cores; batch 8 9.59 against 4.00).
  return m >= 3 && m <= 8 && k % 16 == 0 && block_n > 0 && block_k > 0 &&
         (block_k % gemv_byte_mma::kStepK == 0 || block_k >= k) && quant_mma_enabled();
}

cudaError_t gemv_fp8_mma(void* out, const void* x, int64_t x_stride, const uint8_t* weight,
                         const float* scales, int m, int n, int k, int block_n, int block_k,
                         DType dtype, cudaStream_t stream) {
  const Fp8Blocks format{scales, block_n, block_k, (k + block_k - 1) / block_k};
  return gemv_byte_mma::launch(out, x, x_stride, weight, format, m, n, k, dtype, stream);
}

}  // namespace pagedkv::kernels
