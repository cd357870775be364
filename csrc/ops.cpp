// Every pagedkv op is declared here, once, with a one-line comment. Arguments marked `Tensor!`
// are written by the op; ops return nothing so they can run inside CUDA graphs without
// allocating. Implementations register per device: csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cpp (CUDA).
#include <torch/library.h>

TORCH_LIBRARY(pagedkv, m) {
  // out = weight * rms_normalize(input); HF's rounding: normalize in fp32, round, then scale.
  m.def("rms_norm(Tensor! out, Tensor input, Tensor weight, float epsilon) -> ()");
  // residual = input + residual; input = weight * rms_normalize(residual). Both in place.
  m.def("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()");
  // out = x @ weight^T + bias; decode-sized x (<= 2 rows, 16-bit) streams the weight in a kernel
  // of ours at memory bandwidth, anything larger goes to cuBLAS.
  m.def("linear(Tensor! out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  // out[b, h] = softmax(scale * q[b, h] . K) V over the context_lens[b] tokens block_tables[b] maps
  // to in k_cache/v_cache; workspace: fp32 split partials; num_splits 0: paged_decode_num_splits.
  m.def("paged_decode_attention(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, Tensor! workspace, "
        "int num_splits=0) -> ()");
  // The split count the CUDA path of paged_decode_attention picks from shapes (host only).
  m.def("paged_decode_num_splits(int batch, int num_q_heads, int num_kv_heads, int block_size, "
        "int max_blocks, int num_sms) -> int");
}
