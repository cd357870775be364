// Int4 weight-only skinny GEMM for decode steps. Scales in x's dtype go to the tensor-core kernel
// (gemv_4bit_mma.cu); others (fp16 scales with bf16 x) to this one: the weight-streaming skeleton of
// gemv_dequant.cuh with this format's 16-byte piece: 32 int4 values of one group, dequantized to
// fp32 ((q - zero) * scale is exact in fp32: a 5-bit integer times a 16-bit scale; float zeros:
// (q - 8) * scale + zero, one rounding) and summed straight into the accumulators.
#include <cstdint>
#include <type_traits>

#include "kernels/gemv_dequant.cuh"
#include "kernels/gemv_w4a16.h"
#include "kernels/gemv_4bit_mma.h"

namespace pagedkv::kernels {
namespace {

// Z: uint8 zero points (w = (q - z) * s) or S (float zeros, torchao's: w = (q - 8) * s + z).
template <typename S, typename Z>
struct W4A16 {
  static constexpr int kPieceCols = 32;         // int4 values in 16 bytes
  static constexpr bool kScalePartial = false;  // the scale is in each dequantized weight
  static constexpr int kTableSize = 0;
  static constexpr bool kFloatZeros = !std::is_same_v<Z, uint8_t>;
  const S* scales;  // [n, k / group_size]
  const Z* zeros;   // [n, k / group_size]
  int group_size;

  struct Row {
    const S* scales;  // this row's
    const Z* zeros;   // this row's
    int pieces_per_group;

    __device__ __forceinline__ float dequantize(const uint4& piece, int p, float (&w)[kPieceCols]) const {
      const int g = p / pieces_per_group;
      const float scale = to_float(__ldg(scales + g));
      float zero;
      if constexpr (kFloatZeros) {
        zero = to_float(__ldg(zeros + g));
      } else {
        zero = static_cast<float>(__ldg(zeros + g));
      }
      const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float q = static_cast<float>((words[j] >> (4 * e)) & 0xFu);
          w[8 * j + e] = kFloatZeros ? fmaf(q - 8.f, scale, zero) : (q - zero) * scale;
        }
      return 1.f;  // unused (kScalePartial is false)
    }
  };

  __device__ __forceinline__ Row row(int row, int k, const float*) const {
    const int groups = k / group_size;
    return {scales + static_cast<int64_t>(row) * groups, zeros + static_cast<int64_t>(row) * groups,
            group_size / kPieceCols};
  }
};

}  // namespace

cudaError_t gemv_w4a16(void* out, const void* x, int64_t x_stride, const int32_t* packed,
                       const void* scales, const void* zeros, bool float_zeros, int m, int n, int k,
                       int group_size, int num_sms, DType dtype, DType scale_dtype, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  // Scales in x's dtype (what checkpoints of 16-bit models store): the tensor-core kernel.
  if (scale_dtype == dtype && m <= 8 && quant_mma_enabled()) {
    return gemv_w4a16_mma(out, x, x_stride, packed, scales, zeros, float_zeros, m, n, k, group_size, num_sms,
                          dtype, stream);
  }
  const bool sizes_ok = group_size > 0 && group_size % 32 == 0 && k % group_size == 0;
  return dispatch_dtype(scale_dtype, [&](auto scale_tag) -> cudaError_t {
    using S = decltype(scale_tag);
    if constexpr (sizeof(S) != 2) {
      return cudaErrorInvalidValue;  // scales are 16-bit (checked by the launcher)
    } else if (float_zeros) {
      const W4A16<S, S> format{static_cast<const S*>(scales), static_cast<const S*>(zeros), group_size};
      return gemv_dequant::launch(out, x, x_stride, packed, format, m, n, k, sizes_ok, dtype, stream);
    } else {
      const W4A16<S, uint8_t> format{static_cast<const S*>(scales), static_cast<const uint8_t*>(zeros), group_size};
      return gemv_dequant::launch(out, x, x_stride, packed, format, m, n, k, sizes_ok, dtype, stream);
    }
  });
}

}  // namespace pagedkv::kernels
