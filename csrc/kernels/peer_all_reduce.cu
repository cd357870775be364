// All-reduce over peer memory + residual add + RMSNorm, one launch (see peer_all_reduce.h).
//
// Every launch has kPeerBlocks blocks; block b of every rank handles rows b, b + kPeerBlocks, ...
//   1. each thread writes its 16-byte pieces of this rank's rows into slot [epoch % 2][rank] of
//      every peer's buffer (remote stores over NVLink, nothing waited for);
//   2. it reads the same pieces of every other rank from its own buffer's slots, spinning until
//      no element holds the empty marker (kPeerEmptyByte), and empties them again;
//   3. the block sums every rank's piece in rank order (fp32, so every rank computes the same
//      bits), rounds the sum to T, adds the residual, and normalises the row.
// No flag and no fence: the data is its own signal (each element is written once per epoch, and
// an element is either the marker or the value). Two slots alternate by epoch: a rank finishes
// epoch e only with every peer's epoch-e data, so no peer runs more than one epoch ahead, and a
// slot is emptied by its reader before its writer can reach it again two epochs later.
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/rms_norm.cuh"
#include "kernels/peer_all_reduce.h"

namespace pagedkv::kernels {
namespace {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint4 load_volatile(const uint4* p) {  // sees peers' stores: no L1
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// Whether a 32-bit word holds an element that is still the empty marker (all bits set).
template <int kBytes>
__device__ __forceinline__ bool has_marker(uint32_t w) {
  if constexpr (kBytes == 4) return w == 0xffffffffu;
  return (w & 0xffffu) == 0xffffu || (w >> 16) == 0xffffu;
}

// The word with any element equal to the marker replaced by another NaN (0x7fff / 0x7fffffff).
template <int kBytes>
__device__ __forceinline__ uint32_t without_marker(uint32_t w) {
  if constexpr (kBytes == 4) return w == 0xffffffffu ? 0x7fffffffu : w;
  if ((w & 0xffffu) == 0xffffu) w = (w & 0xffff0000u) | 0x7fffu;
  if ((w >> 16) == 0xffffu) w = (w & 0xffffu) | 0x7fff0000u;
  return w;
}

__device__ __forceinline__ bool ready(const uint4& v, auto has) {
  return !(has(v.x) || has(v.y) || has(v.z) || has(v.w));
}

// input, residual [rows, hidden]; weight [hidden]; buffers: every rank's buffer (layout in
// peer_buffer_layout.h).
template <typename T>
__global__ void __launch_bounds__(1024)
peer_all_reduce_add_rms_norm_kernel(T* input, T* residual, const T* __restrict__ weight,
                                    int64_t rows, int hidden, float epsilon, PeerBuffers buffers,
                                    int rank, int world_size, size_t data_bytes,
                                    uint64_t timeout_ns) {
  // Launched dependently: the next kernel (a GEMV) is scheduled beside this one's 32 blocks and
  // streams its first weight bytes into L2 while these wait for the peers' data.
  begin_dependent_kernel();
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kBytes = sizeof(T);
  using V = Vec<T, kVec>;
  const int block = blockIdx.x;
  const int num_vecs = hidden / kVec;
  char* mine = buffers.base[rank];

  __shared__ uint32_t epoch_shared;
  if (threadIdx.x == 0) {
    uint32_t* epochs = reinterpret_cast<uint32_t*>(mine + PeerBufferLayout::kEpochsOffset);
    epoch_shared = epochs[block] + 1;
    epochs[block] = epoch_shared;
  }
  __syncthreads();
  const uint32_t epoch = epoch_shared;
  const uint4* in = reinterpret_cast<const uint4*>(input);

  // 1. This rank's pieces into every peer's slot for this rank.
  const size_t sent = PeerBufferLayout::slot(epoch, rank, data_bytes, world_size);
  for (int64_t r = block; r < rows; r += gridDim.x) {
    for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
      uint4 v = in[r * num_vecs + i];
      v = make_uint4(without_marker<kBytes>(v.x), without_marker<kBytes>(v.y),
                     without_marker<kBytes>(v.z), without_marker<kBytes>(v.w));
      for (int p = 0; p < world_size; ++p) {
        if (p != rank) reinterpret_cast<uint4*>(buffers.base[p] + sent)[r * num_vecs + i] = v;
      }
    }
  }

  // 2 + 3. Every rank's pieces (this rank's own from input), summed in rank order; add, normalise.
  const auto has = [](uint32_t w) { return has_marker<kBytes>(w); };
  const V* w = reinterpret_cast<const V*>(weight);
  for (int64_t r = block; r < rows; r += gridDim.x) {
    V* res_row = reinterpret_cast<V*>(residual) + r * num_vecs;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
      float acc[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
      for (int s = 0; s < world_size; ++s) {
        uint4 raw;
        if (s == rank) {
          raw = in[r * num_vecs + i];
        } else {
          uint4* piece = reinterpret_cast<uint4*>(mine + PeerBufferLayout::slot(epoch, s, data_bytes, world_size)) +
                         r * num_vecs + i;
          const uint64_t start = global_timer_ns();
          raw = load_volatile(piece);
          for (uint32_t spins = 1; !ready(raw, has); ++spins) {
            if (spins % 1024 == 0 && global_timer_ns() - start > timeout_ns) {
              printf("pagedkv all-reduce: rank %d waited over %llu ms for rank %d (block %d, epoch %u): "
                     "the tensor-parallel ranks are out of step (a rank skipped or added a step)\n",
                     rank, static_cast<unsigned long long>(timeout_ns / 1000000), s, block, epoch);
              __trap();
            }
            raw = load_volatile(piece);
          }
          *piece = make_uint4(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);  // empty again
        }
        V x;
        *reinterpret_cast<uint4*>(&x) = raw;
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[j] += to_float(x.v[j]);
      }
      V res = res_row[i];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const T sum = from_float<T>(acc[j]);  // the all-reduced value in the model's dtype, as HF has it
        res.v[j] = from_float<T>(to_float(sum) + to_float(res.v[j]));
        const float v = to_float(res.v[j]);
        sum_sq += v * v;
      }
      res_row[i] = res;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq) / static_cast<float>(hidden) + epsilon);
    // Each thread re-reads only the residual pieces it wrote above.
    write_normalized_row<T, kVec>(reinterpret_cast<V*>(input) + r * num_vecs, res_row, w, num_vecs, inv_rms);
  }
}

}  // namespace

cudaError_t peer_all_reduce_add_rms_norm(void* input, void* residual, const void* weight,
                                         int64_t rows, int hidden, float epsilon, DType dtype,
                                         const PeerBuffers& buffers, int rank, int world_size,
                                         size_t data_bytes, uint64_t timeout_ns,
                                         cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;  // every rank skips it alike
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const int num_vecs = hidden / kVec;
    const int threads = num_vecs >= 1024 ? 1024 : (num_vecs + 31) / 32 * 32;
    launch_dependent(peer_all_reduce_add_rms_norm_kernel<T>, kPeerBlocks, threads, 0, stream,
                     static_cast<T*>(input), static_cast<T*>(residual), static_cast<const T*>(weight),
                     rows, hidden, epsilon, buffers, rank, world_size, data_bytes, timeout_ns);
    return cudaGetLastError();
  });
}

}  // namespace pagedkv::kernels
