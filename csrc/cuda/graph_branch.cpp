// pagedkv._C.BranchedGraph: owns the graph kernels/graph_branch.h builds and launches it on the
// current stream (runtime/graph_branches.py).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include "cuda/graph_branch.h"
#include "kernels/graph_branch.h"

namespace pagedkv {
namespace {

class BranchedGraph {
 public:
  // head, if_true, if_false: cudaGraph_t handles (torch.cuda.CUDAGraph.raw_cuda_graph() of
  // graphs captured with keep_graph=True); flag: the bool CUDA scalar the head writes.
  BranchedGraph(uintptr_t head, uintptr_t if_true, uintptr_t if_false, at::Tensor flag) : flag_(std::move(flag)) {
    TORCH_CHECK(flag_.is_cuda() && flag_.scalar_type() == at::kBool && flag_.numel() == 1,
                "pagedkv: BranchedGraph's flag must be a bool CUDA tensor of one element, got ",
                flag_.scalar_type(), " on ", flag_.device(), " with ", flag_.numel(), " elements");
    TORCH_CHECK(head && if_true && if_false, "pagedkv: BranchedGraph needs three captured graphs");
    const c10::cuda::CUDAGuard guard(flag_.device());
    C10_CUDA_CHECK(kernels::build_branched_graph(reinterpret_cast<cudaGraph_t>(head),
                                                 reinterpret_cast<cudaGraph_t>(if_true),
                                                 reinterpret_cast<cudaGraph_t>(if_false),
                                                 flag_.const_data_ptr<bool>(), &graph_, &exec_));
  }
  BranchedGraph(const BranchedGraph&) = delete;
  BranchedGraph& operator=(const BranchedGraph&) = delete;
  ~BranchedGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }

  void replay() {
    const c10::cuda::CUDAGuard guard(flag_.device());
    C10_CUDA_CHECK(cudaGraphLaunch(exec_, c10::cuda::getCurrentCUDAStream()));
  }

 private:
  at::Tensor flag_;  // kept alive: the graph reads it at every launch
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace

void register_graph_branch_bindings(pybind11::module_& m) {
  pybind11::class_<BranchedGraph>(m, "BranchedGraph")
      .def(pybind11::init<uintptr_t, uintptr_t, uintptr_t, at::Tensor>())
      .def("replay", &BranchedGraph::replay);
}

}  // namespace pagedkv
