// Int8-weight (bitsandbytes LLM.int8) skinny GEMM for decode steps: the weight-streaming skeleton
// of gemv_dequant.cuh with this format's 16-byte piece: 16 int8 values of one output row,
// converted in registers to fp32 (exact). The row's scale, scb / 127, multiplies each x row's
// 16-term fp32 partial sum: the same product as the dequantized weight's up to fp32 rounding.
#include <cstdint>

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

}  // namespace

cudaError_t gemv_int8(void* out, const void* x, int64_t x_stride, const int8_t* q, const float* scb, int m, int n,
                      int k, DType dtype, cudaStream_t stream) {
  const bool sizes_ok = k % Int8::kPieceCols == 0;
  return gemv_dequant::launch(out, x, x_stride, q, Int8{scb}, m, n, k, sizes_ok, dtype, stream);
}

}  // namespace pagedkv::kernels
