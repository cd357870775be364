// CUDA launcher of copy_blocks: check, guard the device, launch on the current stream (one
// launch per kCopyBlocksMaxLayers layers). The kernel lives in csrc/kernels/copy_blocks.cu.
#include <torch/library.h>

#include <algorithm>

#include "cuda/torch_utils.h"
#include "kernel_checks.h"
#include "kernels/copy_blocks.h"

namespace pagedkv {

void copy_blocks_cuda(const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                      const at::Tensor& src, const at::Tensor& dst) {
  check_copy_blocks_args(k_caches, v_caches, src, dst);
  check_cuda(k_caches[0], "k_caches[0]");
  const c10::cuda::CUDAGuard guard(k_caches[0].device());
  const int64_t num_blocks = k_caches[0].size(0);
  const int64_t block_bytes = k_caches[0].numel() / num_blocks * k_caches[0].element_size();
  const int num_layers = static_cast<int>(k_caches.size());
  for (int first = 0; first < num_layers; first += kernels::kCopyBlocksMaxLayers) {
    const int count = std::min(kernels::kCopyBlocksMaxLayers, num_layers - first);
    kernels::CacheLayers layers{};
    for (int l = 0; l < count; ++l) {
      layers.k[l] = k_caches[first + l].data_ptr();
      layers.v[l] = v_caches[first + l].data_ptr();
    }
    C10_CUDA_CHECK(kernels::copy_blocks(layers, count, src.const_data_ptr(), dst.const_data_ptr(),
                                        src.scalar_type() == at::kLong, src.size(0), num_blocks,
                                        block_bytes, c10::cuda::getCurrentCUDAStream()));
  }
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("copy_blocks", &copy_blocks_cuda); }

}  // namespace pagedkv
