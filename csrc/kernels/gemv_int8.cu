// Int8-weight (bitsandbytes LLM.int8) skinny GEMM for decode steps. 1-2 rows: the weight-streaming
// skeleton of gemv_dequant.cuh with this format's 16-byte piece: 16 int8 values of one output row,
// converted in registers to fp32 (exact). 3-8 rows: the tensor-core kernel of one-byte formats
// (gemv_byte_mma.cuh), the values converted exactly to x's 16-bit type; at 8 rows the CUDA-core
// kernel runs out of issue slots (W1 on one H200: 8.99 ms a step against bf16's 4.38). Either way
// the row's scale, scb / 127, multiplies fp32 partial sums (16 terms on CUDA cores, 64 on tensor
// cores): the same product as the dequantized weight's up to fp32 rounding.
#include <cstdint>
#include <type_traits>

#include "kernels/gemv_4bit_mma.h"  // quant_mma_enabled
#include "kernels/gemv_byte_mma.cuh"
#include "kernels/gemv_dequant.cuh"
#include "kernels/gemv_int8.h"

namespace pagedkv::kernels {
namespace {

// bitsandbytes' fp32 multiplier for 1 / 127 (int8_vectorwise_dequant)
constexpr float kInv127 = 7.874015718698502e-3f;

struct Int8 {
  static constexpr int kPieceCols = 16;  // int8 values in 16 bytes
  static constexpr bool kScalePartial = true;
  static constexpr int kTableSize = 0;
  const float* scb;  // [n]

  struct Row {
    float scale;  // scb[row] / 127

    __device__ __forceinline__ float dequantize(const uint4& piece, int, float (&w)[kPieceCols]) const {
      const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // byte e of word j: column 4j + e (little-endian)
          w[4 * j + e] = static_cast<float>(static_cast<int8_t>((words[j] >> (8 * e)) & 0xFFu));
        }
      return scale;
    }
  };

  __device__ __forceinline__ Row row(int row, int, const float*) const { return {__ldg(scb + row) * kInv127}; }
};

// The tensor-core form: one scale per row over all of k.
struct Int8Rows {
  const float* scb;  // [n]

  // Two int8 values (low byte first) -> the register of two T values, exact (|value| <= 128), in
  // integer and add ops instead of quarter-rate int-to-float conversions. b + 128 as an unsigned
  // byte u is placed in the mantissa of a float whose exponent makes its unit 1: fp16 0x64uu =
  // 1024 + u, fp32 0x4B0000uu = 2^23 + u; subtracting 1024 + 128 (2^23 + 128) leaves b exactly.
  template <typename T>
  __device__ __forceinline__ static uint32_t pair_to(uint32_t two) {
    const uint32_t biased = two ^ 0x8080u;  // u0 = b0 + 128, u1 = b1 + 128
    uint32_t bits;
    if constexpr (std::is_same_v<T, __half>) {
      const uint32_t h = __byte_perm(biased, 0x64646464u, 0x4140);  // [u0 0x64 u1 0x64]
      asm("sub.f16x2 %0, %1, %2;" : "=r"(bits) : "r"(h), "r"(0x64806480u));  // minus 1152 in both
    } else {
      const float lo = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7540)) - 8388736.f;  // [u0 0 0 0x4B]
      const float hi = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7541)) - 8388736.f;
      // an integer of at most 8 significant bits: its bf16 is the fp32's upper half, no rounding
      bits = __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
    }
    return bits;
  }

  __device__ __forceinline__ const float* row_scales(int row) const { return scb + row; }
  __device__ __forceinline__ float step_scale(const float* row, int, int) const { return __ldg(row) * kInv127; }
};

}  // namespace

cudaError_t gemv_int8(void* out, const void* x, int64_t x_stride, const int8_t* q, const float* scb, int m, int n,
                      int k, DType dtype, cudaStream_t stream) {
  const bool sizes_ok = k % Int8::kPieceCols == 0;
  // 1-2 rows stay on CUDA cores, as FP8's (gemv_fp8_mma_takes: measured faster there at batch 1).
  if (sizes_ok && m >= 3 && m <= 8 && quant_mma_enabled()) {
    return gemv_byte_mma::launch(out, x, x_stride, q, Int8Rows{scb}, m, n, k, dtype, stream);
  }
  return gemv_dequant::launch(out, x, x_stride, q, Int8{scb}, m, n, k, sizes_ok, dtype, stream);
}

}  // namespace pagedkv::kernels
