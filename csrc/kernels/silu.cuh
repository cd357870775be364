// silu(gate) * up with HF's rounding, shared by silu_and_mul and the fused gate/up GEMV:
// `act_fn(gate_proj(x)) * up_proj(x)` rounds silu(gate) to the model dtype, then the product.
// silu is torch's CUDA formula, x / (1 + expf(-x)) in fp32 with IEEE division and libdevice's
// accurate expf (__nv_expf), which --use_fast_math would otherwise replace by __expf.
#pragma once
#include "kernels/common.cuh"

extern "C" __device__ float __nv_expf(float);

namespace pagedkv::kernels {

template <typename T>
__device__ __forceinline__ T silu_mul(T gate, T up) {
  const float g = to_float(gate);
  const T silu = from_float<T>(__fdiv_rn(g, __fadd_rn(1.f, __nv_expf(-g))));
  return from_float<T>(__fmul_rn(to_float(silu), to_float(up)));
}

}  // namespace pagedkv::kernels
