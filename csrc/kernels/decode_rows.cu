// advance_decode_rows: one thread per row (see decode_rows.h; csrc/cpu/decode_rows.cpp is the
// same rule on the CPU).
#include "kernels/decode_rows.h"

namespace pagedkv::kernels {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) advance_decode_rows_kernel(const DecodeRows r) {
  const int b = blockIdx.x * kThreads + threadIdx.x;
  if (b >= r.batch) return;
  r.tokens[b] = r.next_tokens[b];
  r.offsets[b] += 1;
  int32_t slot = -1;
  if (r.context_lens[b] > 0) {
    const int32_t pos = r.positions[b] + 1;
    r.positions[b] = pos;
    r.context_lens[b] += 1;
    r.generated[b] += 1;
    const int32_t block = pos / r.block_size;
    if (block < r.max_blocks) {
      slot = r.block_tables[static_cast<int64_t>(b) * r.max_blocks + block] * r.block_size +
             pos % r.block_size;
    }
  }
  r.slot_mapping[b] = slot;
}

}  // namespace

cudaError_t advance_decode_rows(const DecodeRows& rows, cudaStream_t stream) {
  if (rows.batch == 0) return cudaSuccess;
  advance_decode_rows_kernel<<<(rows.batch + kThreads - 1) / kThreads, kThreads, 0, stream>>>(rows);
  return cudaGetLastError();
}

}  // namespace pagedkv::kernels
