// silu(gate) * up with HF's rounding, shared by silu_and_mul and the fused gate/up GEMV:
// `act_fn(gate_proj(x)) * up_proj(x)` rounds silu(gate) to the model dtype, then the product.
// silu is torch's CUDA formula, x / (1 + expf(-x)) in fp32 with IEEE division and libdevice's
// accurate expf (__nv_expf), which --use_fast_math would otherwise replace by __expf.
// gelu_tanh_mul: the same for HF's gelu_pytorch_tanh, torch's CUDA formula
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in fp32, libdevice's accurate tanhf.
// gated_mul<kAct>: the one of them a gated GEMV's epilogue was instantiated for.
#pragma once
#include "kernels/common.cuh"
#include "kernels/gated_act.h"

extern "C" __device__ float __nv_expf(float);
extern "C" __device__ float __nv_tanhf(float);

namespace pagedkv::kernels {

template <typename T>
__device__ __forceinline__ T silu_mul(T gate, T up) {
  const float g = to_float(gate);
  const T silu = from_float<T>(__fdiv_rn(g, __fadd_rn(1.f, __nv_expf(-g))));
  return from_float<T>(__fmul_rn(to_float(silu), to_float(up)));
}

template <typename T>
__device__ __forceinline__ T gelu_tanh_mul(T gate, T up) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi), as torch's M_SQRT2 * M_2_SQRTPI / 2
  constexpr float kKappa = 0.044715f;
  const float g = to_float(gate);
  const float inner = kBeta * (g + kKappa * (g * g * g));
  const T gelu = from_float<T>(0.5f * g * (1.f + __nv_tanhf(inner)));
  return from_float<T>(__fmul_rn(to_float(gelu), to_float(up)));
}

template <GatedAct kAct, typename T>
__device__ __forceinline__ T gated_mul(T gate, T up) {
  static_assert(kAct != GatedAct::kNone, "gated_mul takes a gate's activation");
  if constexpr (kAct == GatedAct::kGeluTanh) {
    return gelu_tanh_mul(gate, up);
  } else {
    return silu_mul(gate, up);
  }
}

}  // namespace pagedkv::kernels
