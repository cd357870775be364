// What every CUDA launcher needs from torch: the device guard, the current stream, the dtype
// mapping to the torch-free kernels, and the launch-status check.
#pragma once
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

}  // namespace pagedkv
