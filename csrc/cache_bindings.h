// The cache manager's Python classes, added to pagedkv._C by bindings.cpp.
#pragma once
#include <pybind11/pybind11.h>

namespace pagedkv {

void register_cache_bindings(pybind11::module_& m);

}  // namespace pagedkv
