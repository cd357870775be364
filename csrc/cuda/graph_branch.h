// pagedkv._C.BranchedGraph (bindings.cpp adds it in a CUDA build).
#pragma once
#include <pybind11/pybind11.h>

namespace pagedkv {

void register_graph_branch_bindings(pybind11::module_& m);

}  // namespace pagedkv
