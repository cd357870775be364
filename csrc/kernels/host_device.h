// PAGEDKV_HD marks a function that the CPU and CUDA implementations of an op share, so both
// compute the same thing: a device function under nvcc, a plain inline one for the host compiler.
#pragma once

#if defined(__CUDACC__)
#define PAGEDKV_HD __host__ __device__ __forceinline__
#else
#define PAGEDKV_HD inline
#endif
