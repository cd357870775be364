// All-reduce over peer memory + residual add + RMSNorm, one launch (see peer_all_reduce.h).
//
// Every launch has kPeerBlocks blocks; block b of every rank handles rows b, b + kPeerBlocks, ...
// and synchronises only with block b of the other ranks:
//   1. block b copies this rank's rows into its own buffer's data area (epoch parity);
//   2. thread p announces the epoch in rank p's flags (release, system scope) and waits until
//      rank p's block b announced it here (acquire);
//   3. the block sums every rank's copy of its rows in rank order (fp32, so each rank computes
//      the same bits), rounds the sum to T, adds the residual, and normalises the row.
// Why parity is enough: a rank enters launch k + 2, which reuses launch k's data area, only
// after its launch k + 1 completed, and that needed every peer's launch k + 1 to start, which
// (stream order) comes after the peer's launch k finished reading.
#include <cstdint>
#include <cstdio>

#include "kernels/common.cuh"
#include "kernels/peer_all_reduce.h"

namespace pagedkv::kernels {
namespace {

__device__ __forceinline__ void store_release_system(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_system(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// input, residual [rows, hidden]; weight [hidden]; buffers: every rank's buffer (layout in the .h).
template <typename T>
__global__ void __launch_bounds__(1024)
peer_all_reduce_add_rms_norm_kernel(T* input, T* residual, const T* __restrict__ weight,
                                    int64_t rows, int hidden, float epsilon, PeerBuffers buffers,
                                    int rank, int world_size, size_t data_bytes,
                                    uint64_t timeout_ns) {
  constexpr int kVec = 16 / sizeof(T);
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
  const size_t area = PeerBufferLayout::kDataOffset + (epoch & 1u) * data_bytes;

  // 1. This rank's rows of this block, into its own buffer.
  V* own_rows = reinterpret_cast<V*>(mine + area);
  const V* in = reinterpret_cast<const V*>(input);
  for (int64_t r = block; r < rows; r += gridDim.x) {
    for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) own_rows[r * num_vecs + i] = in[r * num_vecs + i];
  }
  __syncthreads();

  // 2. Tell every rank this block's rows are there; wait until every rank's are.
  if (threadIdx.x < world_size) {
    const int peer = threadIdx.x;
    __threadfence_system();  // the block's copies (ordered before this by the barrier) go first
    uint32_t* their_flags = reinterpret_cast<uint32_t*>(buffers.base[peer] + PeerBufferLayout::kFlagsOffset);
    store_release_system(their_flags + block * kPeerMaxRanks + rank, epoch);
    const uint32_t* own_flags = reinterpret_cast<const uint32_t*>(mine + PeerBufferLayout::kFlagsOffset);
    const uint32_t* flag = own_flags + block * kPeerMaxRanks + peer;
    const uint64_t start = global_timer_ns();
    for (uint32_t spins = 1; static_cast<int32_t>(load_acquire_system(flag) - epoch) < 0; ++spins) {
      if (spins % 1024 == 0 && global_timer_ns() - start > timeout_ns) {
        printf("pagedkv all-reduce: rank %d waited over %llu ms for rank %d (block %d, epoch %u): "
               "the tensor-parallel ranks are out of step (a rank skipped or added a step)\n",
               rank, static_cast<unsigned long long>(timeout_ns / 1000000), peer, block, epoch);
        __trap();
      }
    }
  }
  __syncthreads();

  // 3. Sum in rank order, add the residual, normalise.
  const V* w = reinterpret_cast<const V*>(weight);
  for (int64_t r = block; r < rows; r += gridDim.x) {
    V* res_row = reinterpret_cast<V*>(residual) + r * num_vecs;
    float sum_sq = 0.f;
    for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {
      float acc[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
      for (int p = 0; p < world_size; ++p) {
        // L2 only: a peer's row at this address may have been read into L1 two launches ago.
        const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(buffers.base[p] + area) + r * num_vecs + i);
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
    V* out_row = reinterpret_cast<V*>(input) + r * num_vecs;
    for (int i = threadIdx.x; i < num_vecs; i += blockDim.x) {  // re-reads its own writes only
      const V x = res_row[i];
      const V g = w[i];
      V y;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const T normed = from_float<T>(to_float(x.v[j]) * inv_rms);
        y.v[j] = from_float<T>(to_float(g.v[j]) * to_float(normed));
      }
      out_row[i] = y;
    }
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
    peer_all_reduce_add_rms_norm_kernel<T><<<kPeerBlocks, threads, 0, stream>>>(
        static_cast<T*>(input), static_cast<T*>(residual), static_cast<const T*>(weight), rows,
        hidden, epsilon, buffers, rank, world_size, data_bytes, timeout_ns);
    return cudaGetLastError();
  });
}

}  // namespace pagedkv::kernels
