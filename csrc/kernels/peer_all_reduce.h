// Torch-free launcher of the all-reduce over peer memory fused with the residual add + RMSNorm
// that follows it in a tensor-parallel decoder layer, and the layout of the buffer each rank
// shares with its peers (CUDA IPC on GPUs; plain host memory for the CPU twin's in-process ranks).
//
// Why not NCCL for these: a decode step all-reduces a few KB twice per layer; NCCL's latency for
// such a message (~9 us with the norm after it, inside a CUDA graph on 2 H200s) adds up to a
// sixth of the step at TP=2. Here every rank writes its partial sums straight into every peer's
// buffer and reads the others' from its own: one one-way trip over NVLink, a few us.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/dtype.h"
#include "kernels/peer_buffer_layout.h"

namespace pagedkv::kernels {

struct PeerBuffers {
  char* base[kPeerMaxRanks];  // every rank's buffer as this rank addresses it; base[rank] its own
};

// input [rows, hidden]: this rank's partial sums; on return the RMSNorm of the new residual.
// residual [rows, hidden]: += round(sum of every rank's input, in rank order). weight [hidden].
// buffers: this rank's own and its peers' (layout in peer_buffer_layout.h, world_size slots).
// rows * hidden * sizeof(dtype) <= data_bytes; hidden * sizeof(dtype) % 16 == 0; input 16-byte
// aligned. A peer that does not arrive within timeout_ns traps (the CUDA context fails loudly:
// the ranks are out of step, and any other outcome would be a hang or a wrong sum).
cudaError_t peer_all_reduce_add_rms_norm(void* input, void* residual, const void* weight,
                                         int64_t rows, int hidden, float epsilon, DType dtype,
                                         const PeerBuffers& buffers, int rank, int world_size,
                                         size_t data_bytes, uint64_t timeout_ns,
                                         cudaStream_t stream);

}  // namespace pagedkv::kernels
