// The pybind11 module pagedkv._C. Loading it also registers the TORCH_LIBRARY(pagedkv) ops
// (static initializers in ops.cpp, cpu/ and cuda/). Only ints, lists and tensors cross here.
#include <torch/extension.h>

#include "build_info.h"
#include "cache_bindings.h"
#include "kernels/peer_buffer_layout.h"
#ifdef PAGEDKV_WITH_CUDA
#include "cuda/graph_branch.h"
#include "cuda/peer_all_reduce.h"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkv C++/CUDA core";
  m.attr("build_info") = PAGEDKV_BUILD_INFO;
#ifdef PAGEDKV_WITH_CUDA
  m.attr("with_cuda") = true;
  pagedkv::register_peer_buffer_bindings(m);
  pagedkv::register_graph_branch_bindings(m);
#else
  m.attr("with_cuda") = false;
#endif
  pagedkv::register_cache_bindings(m);
  // The bytes before a peer buffer's data areas (flags and epochs): runtime/peer_all_reduce.py.
  m.attr("peer_buffer_header_bytes") = pagedkv::kernels::PeerBufferLayout::kDataOffset;
}
