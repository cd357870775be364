// The CUDA IPC buffer functions of pagedkv._C (bindings.cpp adds them in a CUDA build).
#pragma once
#include <pybind11/pybind11.h>

namespace pagedkv {

void register_peer_buffer_bindings(pybind11::module_& m);

}  // namespace pagedkv
