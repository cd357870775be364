// copy_blocks: grid (pair, layer, K or V); each thread block copies one cache block in the
// widest unit (16, 8, 4, 2 or 1 bytes) that the block size and base pointers allow.
#include <cstdint>

#include "kernels/copy_blocks.h"

namespace pagedkv::kernels {
namespace {

constexpr int kThreads = 256;

template <typename Unit, typename Index>
__global__ void __launch_bounds__(kThreads) copy_blocks_kernel(const __grid_constant__ CacheLayers layers,
                                                               const Index* __restrict__ src,
                                                               const Index* __restrict__ dst,
                                                               int64_t num_blocks, int64_t block_units) {
  const int64_t s = src[blockIdx.x];
  const int64_t d = dst[blockIdx.x];
  if (s < 0 || s >= num_blocks || d < 0 || d >= num_blocks) return;
  Unit* base = static_cast<Unit*>(blockIdx.z == 0 ? layers.k[blockIdx.y] : layers.v[blockIdx.y]);
  const Unit* from = base + s * block_units;
  Unit* to = base + d * block_units;
  for (int64_t i = threadIdx.x; i < block_units; i += kThreads) to[i] = from[i];
}

template <typename Unit>
cudaError_t launch(const CacheLayers& layers, int num_layers, const void* src, const void* dst,
                   bool index_is_int64, int64_t num_pairs, int64_t num_blocks, int64_t block_bytes,
                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_layers), 2);
  const int64_t units = block_bytes / static_cast<int64_t>(sizeof(Unit));
  if (index_is_int64) {
    copy_blocks_kernel<Unit, int64_t><<<grid, kThreads, 0, stream>>>(
        layers, static_cast<const int64_t*>(src), static_cast<const int64_t*>(dst), num_blocks, units);
  } else {
    copy_blocks_kernel<Unit, int32_t><<<grid, kThreads, 0, stream>>>(
        layers, static_cast<const int32_t*>(src), static_cast<const int32_t*>(dst), num_blocks, units);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t copy_blocks(const CacheLayers& layers, int num_layers, const void* src, const void* dst,
                        bool index_is_int64, int64_t num_pairs, int64_t num_blocks,
                        int64_t block_bytes, cudaStream_t stream) {
  if (num_pairs == 0 || num_layers == 0 || block_bytes == 0) return cudaSuccess;
  uintptr_t alignment = static_cast<uintptr_t>(block_bytes);
  for (int l = 0; l < num_layers; ++l) {
    alignment |= reinterpret_cast<uintptr_t>(layers.k[l]) | reinterpret_cast<uintptr_t>(layers.v[l]);
  }
  const auto args = [&](auto unit) {
    return launch<decltype(unit)>(layers, num_layers, src, dst, index_is_int64, num_pairs,
                                  num_blocks, block_bytes, stream);
  };
  if (alignment % 16 == 0) return args(uint4{});
  if (alignment % 8 == 0) return args(uint2{});
  if (alignment % 4 == 0) return args(uint32_t{});
  if (alignment % 2 == 0) return args(uint16_t{});
  return args(uint8_t{});
}

}  // namespace pagedkv::kernels
