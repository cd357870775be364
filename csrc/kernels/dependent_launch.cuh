// Programmatic dependent launch (Hopper+): a kernel launched with launch_dependent() may be
// scheduled while the kernel before it in the stream is still finishing, so its launch latency
// and the previous kernel's tail wave overlap instead of adding up (~1-2 us a kernel boundary, and
// a decode step of a small model has ~250 of them). Every kernel launched this way starts with
// begin_dependent_kernel(): it waits until the previous kernel has completed and its writes are
// visible, then lets the next kernel be scheduled. Because each such kernel waits before it
// finishes, "previous completed" holds transitively down the stream. Kernels launched another way
// (cuBLAS, torch) are ordered as usual. Before sm_90 the instructions compile to nothing and the
// attribute has no effect. PAGEDKV_PDL=0 turns the attribute off (an A/B switch for benchmarks).
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace pagedkv::kernels {

// Waits until the previous kernel in the stream has completed and its writes are visible.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel be scheduled once every block of this one has called it (or exited).
__device__ __forceinline__ void let_next_kernel_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void begin_dependent_kernel() {
  wait_for_previous_kernel();
  let_next_kernel_launch();
}

inline bool dependent_launch_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("PAGEDKV_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

// kernel<<<grid, block, smem, stream>>>(args...), allowed to start before the previous kernel in
// the stream ends. The kernel must call begin_dependent_kernel() before anything else.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = dependent_launch_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace pagedkv::kernels
