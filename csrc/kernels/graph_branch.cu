// build_branched_graph (kernels/graph_branch.h): the conditional node and the kernel that sets it.
#include "kernels/graph_branch.h"

namespace pagedkv::kernels {
namespace {

// One thread: the condition of this launch of the graph, read from the flag the head wrote.
__global__ void set_branch_kernel(cudaGraphConditionalHandle handle, const bool* flag) {
  cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}

}  // namespace

cudaError_t build_branched_graph(cudaGraph_t head, cudaGraph_t if_true, cudaGraph_t if_false,
                                 const bool* flag, cudaGraph_t* graph_out, cudaGraphExec_t* exec_out) {
  cudaGraph_t graph = nullptr;
  cudaError_t error = cudaGraphCreate(&graph, 0);
  if (error != cudaSuccess) return error;
  auto fail = [&](cudaError_t e) {
    cudaGraphDestroy(graph);
    return e;
  };
  cudaGraphNode_t head_node, set_node, branch_node, body_node;
  if ((error = cudaGraphAddChildGraphNode(&head_node, graph, nullptr, 0, head)) != cudaSuccess) return fail(error);
  cudaGraphConditionalHandle handle;
  // Reset to 0 at every launch; set_branch_kernel always writes it before the node reads it.
  if ((error = cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault)) != cudaSuccess) {
    return fail(error);
  }
  cudaKernelNodeParams setter = {};
  void* args[] = {&handle, &flag};
  setter.func = reinterpret_cast<void*>(set_branch_kernel);
  setter.gridDim = dim3(1);
  setter.blockDim = dim3(1);
  setter.kernelParams = args;
  if ((error = cudaGraphAddKernelNode(&set_node, graph, &head_node, 1, &setter)) != cudaSuccess) return fail(error);
  cudaGraphNodeParams branch = {};
  branch.type = cudaGraphNodeTypeConditional;
  branch.conditional.handle = handle;
  branch.conditional.type = cudaGraphCondTypeIf;
  branch.conditional.size = 2;  // [0] when the condition is non-zero, [1] when it is zero
#if CUDART_VERSION >= 13000
  error = cudaGraphAddNode(&branch_node, graph, &set_node, nullptr, 1, &branch);
#else
  error = cudaGraphAddNode(&branch_node, graph, &set_node, 1, &branch);
#endif
  if (error != cudaSuccess) return fail(error);
  if ((error = cudaGraphAddChildGraphNode(&body_node, branch.conditional.phGraph_out[0], nullptr, 0, if_true)) !=
      cudaSuccess) {
    return fail(error);
  }
  if ((error = cudaGraphAddChildGraphNode(&body_node, branch.conditional.phGraph_out[1], nullptr, 0, if_false)) !=
      cudaSuccess) {
    return fail(error);
  }
  if ((error = cudaGraphInstantiate(exec_out, graph, 0)) != cudaSuccess) return fail(error);
  *graph_out = graph;
  return cudaSuccess;
}

}  // namespace pagedkv::kernels
