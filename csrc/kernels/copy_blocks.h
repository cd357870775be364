// Torch-free launcher of copy_blocks: copy whole cache blocks, for every layer's K and V cache,
// in one launch. Layer base pointers travel in the kernel's parameters (no device array to
// allocate or fill), kMaxLayers at a time.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

namespace pagedkv::kernels {

constexpr int kCopyBlocksMaxLayers = 64;

struct CacheLayers {
  void* k[kCopyBlocksMaxLayers];  // each [num_blocks, block_bytes] as bytes
  void* v[kCopyBlocksMaxLayers];
};

// For l < num_layers, i < num_pairs: block dst[i] of layers.k[l] and layers.v[l] becomes a copy of
// block src[i]. src/dst [num_pairs] int32 (index_is_int64 false) or int64; ids outside
// [0, num_blocks) are skipped.
cudaError_t copy_blocks(const CacheLayers& layers, int num_layers, const void* src, const void* dst,
                        bool index_is_int64, int64_t num_pairs, int64_t num_blocks,
                        int64_t block_bytes, cudaStream_t stream);

}  // namespace pagedkv::kernels
