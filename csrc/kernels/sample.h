// Torch-free launcher of the sampling kernel: one token id per logits row, greedy or sampled.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"

namespace pagedkv::kernels {

struct SampleArgs {
  void* out;                   // [batch] int64 (out_is_int64) or int32 token ids; -1 for a
                               //   sampled row whose max logit is NaN or +-inf
  bool out_is_int64;
  const void* logits;          // [batch, vocab], rows row_stride elements apart
  int64_t row_stride;
  int batch, vocab;
  const float* temperatures;   // [batch] or nullptr (all greedy); <= 0 (or NaN) = greedy row
  const int32_t* top_k;        // [batch] or nullptr; outside (0, vocab) = off
  const float* top_p;          // [batch] or nullptr; >= 1 (or NaN) = off
  const int64_t* seeds;        // [batch], needed when temperatures is given
  const int64_t* offsets;      // [batch], the per-request step counter
  // [batch, sample_chunks(vocab)] each, or nullptr: a row's max (packed argmax key) and its
  // weight total per chunk of kSampleChunk logits, so that long rows are read by many blocks.
  uint64_t* chunk_best;
  uint64_t* chunk_weight;
};

// Logits per chunk of a row when rows are split across thread blocks (a multiple of every
// vector width, so chunks of an aligned row stay aligned).
constexpr int kSampleChunk = 8192;

// Chunks of a row; 0 when rows are not split (short rows, or more rows than a grid's y extent).
inline int sample_chunks(int batch, int vocab) {
  return vocab > kSampleChunk && batch <= 65535 ? (vocab + kSampleChunk - 1) / kSampleChunk : 0;
}

cudaError_t sample(const SampleArgs& args, DType dtype, cudaStream_t stream);

}  // namespace pagedkv::kernels
