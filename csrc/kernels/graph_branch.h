// A CUDA graph that runs a head graph, then one of two branch graphs picked on the device by a
// bool flag the head wrote: a conditional IF/ELSE node (CUDA 12.8+) whose bodies are the
// branches, cloned in as child graphs. runtime/graph_branches.py captures the three graphs with
// torch (their memory stays in torch's graph pool) and builds this from them.
#pragma once
#include <cuda_runtime.h>

namespace pagedkv::kernels {

// head -> set the condition from *flag -> IF (flag) if_true ELSE if_false. The three graphs are
// cloned (the caller keeps and frees its own); *graph_out and *exec_out are the caller's to
// destroy. On an error nothing is left allocated.
cudaError_t build_branched_graph(cudaGraph_t head, cudaGraph_t if_true, cudaGraph_t if_false,
                                 const bool* flag, cudaGraph_t* graph_out, cudaGraphExec_t* exec_out);

}  // namespace pagedkv::kernels
