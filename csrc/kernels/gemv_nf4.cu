// NF4-weight skinny GEMM for decode steps. 1..8 rows go to the tensor-core kernel
// (gemv_4bit_mma.cu, unless PAGEDKV_QUANT_MMA=0); this is the weight-streaming skeleton of gemv_dequant.cuh with
// this format's 16-byte piece: 32 4-bit codes of one absmax block (block_size % 32 == 0), each
// looked up in the 16-entry fp32 codebook (in shared memory: one load per CTA). The block's absmax
// multiplies each row's 32-term fp32 partial sum once.
#include <cstdint>

#include "kernels/gemv_dequant.cuh"
#include "kernels/gemv_4bit_mma.h"
#include "kernels/gemv_nf4.h"

namespace pagedkv::kernels {
namespace {

struct Nf4 {
  static constexpr int kPieceCols = 32;  // 4-bit codes in 16 bytes
  static constexpr bool kScalePartial = true;
  static constexpr int kTableSize = 16;
  const float* absmax;  // [n, k / block_size]
  const float* table;   // [16] the codebook, copied to shared memory by the skeleton
  int block_size;

  struct Row {
    const float* absmax;    // this row's
    const float* codebook;  // [16] in shared memory
    int pieces_per_block;

    __device__ __forceinline__ float dequantize(const uint4& piece, int p, float (&w)[kPieceCols]) const {
      const float scale = __ldg(absmax + p / pieces_per_block);
      const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // byte e of word j: column 8j + 2e high, 8j + 2e + 1 low
          w[8 * j + 2 * e] = codebook[(words[j] >> (8 * e + 4)) & 0xFu];
          w[8 * j + 2 * e + 1] = codebook[(words[j] >> (8 * e)) & 0xFu];
        }
      return scale;
    }
  };

  __device__ __forceinline__ Row row(int row, int k, const float* shared_table) const {
    return {absmax + static_cast<int64_t>(row) * (k / block_size), shared_table, block_size / kPieceCols};
  }
};

}  // namespace

cudaError_t gemv_nf4(void* out, const void* x, int64_t x_stride, const uint8_t* packed, const float* absmax,
                     const float* code, int m, int n, int k, int block_size, int num_sms, DType dtype,
                     cudaStream_t stream) {
  if (m > 0 && m <= 8 && n > 0 && quant_mma_enabled()) {  // the tensor-core kernels
    const int blocks_per_64 = block_size / 64;
    if (block_size % 64 == 0 && blocks_per_64 > 0 && (blocks_per_64 & (blocks_per_64 - 1)) == 0) {
      return gemv_nf4_block_scaled_mma(out, x, x_stride, packed, absmax, code, m, n, k, block_size, num_sms,
                                       dtype, stream);
    }
    return gemv_nf4_mma(out, x, x_stride, packed, absmax, code, m, n, k, block_size, num_sms, dtype, stream);
  }
  const bool sizes_ok = block_size > 0 && block_size % Nf4::kPieceCols == 0 && k % block_size == 0;
  return gemv_dequant::launch(out, x, x_stride, packed, Nf4{absmax, code, block_size}, m, n, k, sizes_ok, dtype,
                              stream);
}

}  // namespace pagedkv::kernels
