// advance_decode_rows: one thread per row applies the rule of advance_decode_rows_rule.h (the
// CPU loops over rows with the same function).
#include "kernels/advance_decode_rows.h"
#include "kernels/dependent_launch.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) advance_decode_rows_kernel(const DecodeRows r) {
  begin_dependent_kernel();
  const int b = blockIdx.x * kThreads + threadIdx.x;
  if (b >= r.batch) return;
  advance_row(r, b);
}

}  // namespace

cudaError_t advance_decode_rows(const DecodeRows& rows, cudaStream_t stream) {
  if (rows.batch == 0) return cudaSuccess;
  launch_dependent(advance_decode_rows_kernel, (rows.batch + kThreads - 1) / kThreads, kThreads, 0, stream, rows);
  return cudaGetLastError();
}

}  // namespace pagedkv::kernels
