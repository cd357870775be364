// Argument checks of peer_all_reduce_add_rms_norm, shared by its CPU twin and CUDA launcher.
#pragma once
#include <cstdint>

#include <torch/types.h>

#include "checks.h"
#include "kernels/peer_buffer_layout.h"

namespace pagedkv {

// The bytes of one data area of `buffer` (layout: kernels/peer_buffer_layout.h).
inline size_t check_peer_all_reduce_args(const at::Tensor& input, const at::Tensor& residual,
                                         const at::Tensor& weight, double epsilon,
                                         const at::Tensor& buffer, c10::IntArrayRef peer_buffers,
                                         int64_t rank, int64_t timeout_ms) {
  using kernels::PeerBufferLayout;
  check_norm_args(residual, "residual", input, "input", weight, epsilon);
  check_same_device(buffer, input, "buffer", "input");
  const int64_t world = static_cast<int64_t>(peer_buffers.size());
  TORCH_CHECK(world >= 1 && world <= kernels::kPeerMaxRanks, "pagedkv: peer_buffers names ", world,
              " ranks; allowed: 1 to ", kernels::kPeerMaxRanks);
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous() &&
                  buffer.numel() > static_cast<int64_t>(PeerBufferLayout::kDataOffset),
              "pagedkv: buffer must be a contiguous uint8 peer buffer of more than ",
              PeerBufferLayout::kDataOffset, " bytes, got ", buffer.scalar_type(), " of shape ",
              buffer.sizes());
  TORCH_CHECK(rank >= 0 && rank < world, "pagedkv: rank ", rank, " is not in [0, ", world, ")");
  TORCH_CHECK(peer_buffers[rank] == reinterpret_cast<int64_t>(buffer.data_ptr()),
              "pagedkv: peer_buffers[", rank, "] must be this rank's own buffer's address");
  TORCH_CHECK(timeout_ms > 0, "pagedkv: timeout_ms must be > 0, got ", timeout_ms);
  // Two epochs' slots, one per rank (peer_buffer_layout.h).
  const size_t data_bytes = (static_cast<size_t>(buffer.numel()) - PeerBufferLayout::kDataOffset) / (2 * world);
  const size_t row_bytes = static_cast<size_t>(input.size(-1)) * input.element_size();
  const size_t bytes = static_cast<size_t>(input.numel()) * input.element_size();
  TORCH_CHECK(bytes <= data_bytes, "pagedkv: input holds ", bytes, " bytes, more than the peer "
              "buffer's data area of ", data_bytes, " bytes; all-reduce larger messages another way");
  TORCH_CHECK(row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(residual.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              "pagedkv: peer_all_reduce_add_rms_norm needs rows of a multiple of 16 bytes (got ",
              row_bytes, ") and 16-byte aligned input, residual and weight");
  return data_bytes;
}

}  // namespace pagedkv
