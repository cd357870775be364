// CUDA launcher of moe_route: check, guard the device, launch on the current stream. The kernel
// lives in csrc/kernels/moe_route.cu.
#include <torch/library.h>

#include "cuda/torch_utils.h"
#include "kernels/moe_route.h"
#include "moe_checks.h"

namespace pagedkv {

void moe_route_cuda(at::Tensor& expert_ids, at::Tensor& weights, const at::Tensor& x, const at::Tensor& router,
                    bool normalize) {
  check_moe_route_args(expert_ids, weights, x, router);
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(kernels::moe_route(expert_ids.data_ptr<int64_t>(), weights.data_ptr(),
                                    weights.scalar_type() == at::kFloat, x.const_data_ptr(), router.const_data_ptr(),
                                    x.size(0), expert_ids.size(1), router.size(0), x.size(1), normalize,
                                    kernel_dtype(x), c10::cuda::getCurrentCUDAStream()));
}

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("moe_route", &moe_route_cuda); }

}  // namespace pagedkv
