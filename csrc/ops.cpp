// Every pagedkv op is declared here, once, with a one-line comment. Arguments marked `Tensor!`
// are written by the op; ops return nothing so they can run inside CUDA graphs without
// allocating. Implementations register per device: csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cpp (CUDA).
#include <torch/library.h>

TORCH_LIBRARY(pagedkv, m) {
  // out = weight * rms_normalize(input); HF's rounding: normalize in fp32, round, then scale.
  m.def("rms_norm(Tensor! out, Tensor input, Tensor weight, float epsilon) -> ()");
  // residual = input + residual; input = weight * rms_normalize(residual). Both in place.
  m.def("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()");
  // out = x @ weight^T + bias; decode-sized x (<= 8 rows, 16-bit) streams the weight in a kernel
  // of ours at memory bandwidth, anything larger goes to cuBLAS.
  m.def("linear(Tensor! out, Tensor x, Tensor weight, Tensor? bias) -> ()");
}
