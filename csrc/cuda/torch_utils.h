// What every CUDA launcher needs from torch: the device guard, the current stream, the dtype
// mapping to the torch-free kernels, and the launch-status check.
#pragma once
#include <array>
#include <atomic>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>

#include "kernels/alignment.h"
#include "kernels/dtype.h"

namespace pagedkv {

inline kernels::DType kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::DType::kFloat32;
    case at::kHalf: return kernels::DType::kFloat16;
    case at::kBFloat16: return kernels::DType::kBFloat16;
    default:
      TORCH_CHECK(false, "pagedkv: dtype ", t.scalar_type(),
                  " has no CUDA kernel; allowed: torch.float32, torch.float16, torch.bfloat16");
  }
}

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "pagedkv: ", name, " is on ", t.device(), "; this op's tensors must all be on one CUDA device");
}

// The device's SM count, read once per device, then cached: a driver query per call would cost
// more than the launch.
inline int sm_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};  // 0: not read yet
  int n = device >= 0 && device < 64 ? cache[device].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    if (device >= 0 && device < 64) cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace pagedkv
