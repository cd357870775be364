// CUDA launcher of sample: check, guard the device, launch on the current stream. The kernel
// lives in csrc/kernels/sample.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernel_checks.h"
#include "kernels/sample.h"

namespace pagedkv {

void sample_cuda(at::Tensor& out, const at::Tensor& logits, const std::optional<at::Tensor>& temperatures,
                 const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                 const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& offsets) {
  check_sample_args(out, logits, temperatures, top_k, top_p, seeds, offsets);
  check_cuda(logits, "logits");
  const c10::cuda::CUDAGuard guard(logits.device());
  kernels::SampleArgs args{};
  args.out = out.data_ptr();
  args.out_is_int64 = out.scalar_type() == at::kLong;
  args.logits = logits.const_data_ptr();
  args.row_stride = logits.stride(0);
  args.batch = static_cast<int>(logits.size(0));
  args.vocab = static_cast<int>(logits.size(1));
  args.temperatures = temperatures ? temperatures->const_data_ptr<float>() : nullptr;
  args.top_k = top_k ? top_k->const_data_ptr<int32_t>() : nullptr;
  args.top_p = top_p ? top_p->const_data_ptr<float>() : nullptr;
  args.seeds = seeds ? seeds->const_data_ptr<int64_t>() : nullptr;
  args.offsets = offsets ? offsets->const_data_ptr<int64_t>() : nullptr;
  // Long rows are read by many blocks; their per-chunk maxima and weight totals live here
  // (from torch's allocator, so also inside a CUDA graph's capture).
  at::Tensor chunk_stats;
  if (const int chunks = kernels::sample_chunks(args.batch, args.vocab); chunks > 0) {
    chunk_stats = at::empty({2, args.batch, chunks}, logits.options().dtype(at::kLong));
    args.chunk_best = reinterpret_cast<uint64_t*>(chunk_stats.data_ptr<int64_t>());
    args.chunk_weight = args.chunk_best + static_cast<int64_t>(args.batch) * chunks;
  }
  C10_CUDA_CHECK(kernels::sample(args, kernel_dtype(logits), c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("sample", &sample_cuda); }

}  // namespace pagedkv
