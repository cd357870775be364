// What the epilogue of a weight-streaming GEMV applies (kernels/gemv.h): the plain product, or a
// gated MLP's act(x @ gate^T) * (x @ up^T) over a fused [gate; up] weight. A template parameter
// of the kernels, named without torch like DType.
#pragma once
#include <type_traits>

#include <cuda_runtime_api.h>

namespace pagedkv::kernels {

// kSilu: Llama's SiLU; kGeluTanh: HF's gelu_pytorch_tanh (Gemma's). Both with HF's rounding
// (kernels/silu.cuh).
enum class GatedAct { kNone, kSilu, kGeluTanh };

// Weight rows behind one output column: one, or its gate row and its up row.
constexpr int weight_rows_per_output(GatedAct act) { return act == GatedAct::kNone ? 1 : 2; }

// Runs body(std::integral_constant<GatedAct, kAct>{}) with kAct == act: the run-time choice made a
// template argument, as dispatch_dtype does for DType. body returns a cudaError_t.
template <typename F>
cudaError_t dispatch_gated_act(GatedAct act, F&& body) {
  switch (act) {
    case GatedAct::kNone: return body(std::integral_constant<GatedAct, GatedAct::kNone>{});
    case GatedAct::kSilu: return body(std::integral_constant<GatedAct, GatedAct::kSilu>{});
    case GatedAct::kGeluTanh: return body(std::integral_constant<GatedAct, GatedAct::kGeluTanh>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace pagedkv::kernels
