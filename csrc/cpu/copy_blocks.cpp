// CPU copy_blocks: memcpy of whole blocks, every layer's K and V. Block ids are checked here (the
// CUDA kernel, which cannot raise, skips ids outside [0, num_blocks)).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "kernel_checks.h"

namespace pagedkv {

void copy_blocks_cpu(const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& src, const at::Tensor& dst) {
  check_copy_blocks_args(k_caches, v_caches, src, dst);
  const int64_t num_blocks = k_caches[0].size(0);
  const int64_t block_bytes = k_caches[0].numel() / num_blocks * k_caches[0].element_size();
  const auto block_id = [](const at::Tensor& ids, int64_t i) -> int64_t {
    return ids.scalar_type() == at::kLong ? ids.const_data_ptr<int64_t>()[i]
                                          : ids.const_data_ptr<int32_t>()[i];
  };
  const int64_t num_pairs = src.size(0);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t s = block_id(src, i), d = block_id(dst, i);
    TORCH_CHECK(s >= 0 && s < num_blocks && d >= 0 && d < num_blocks, "pagedkv: copy_blocks pair ",
                i, " (", s, " -> ", d, ") is outside the cache's [0, ", num_blocks, ") blocks");
  }
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  at::parallel_for(0, num_layers * num_pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t layer = job / num_pairs;
      const int64_t s = block_id(src, job % num_pairs), d = block_id(dst, job % num_pairs);
      for (const auto* caches : {&k_caches, &v_caches}) {
        auto* base = static_cast<char*>((*caches)[layer].data_ptr());
        std::memcpy(base + d * block_bytes, base + s * block_bytes, block_bytes);
      }
    }
  });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("copy_blocks", &copy_blocks_cpu); }

}  // namespace pagedkv
