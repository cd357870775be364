// The element types the torch-free kernels take, named without torch so kernel code never
// includes torch headers (nvcc compiles only small files, and the build stays fast).
#pragma once

namespace pagedkv::kernels {

enum class DType { kFloat32, kFloat16, kBFloat16 };

}  // namespace pagedkv::kernels
