// The buffer each tensor-parallel rank shares with its peers for the fused all-reduce
// (kernels/peer_all_reduce.h; the CPU twin in cpu/peer_all_reduce.cpp uses the same layout).
// Torch- and CUDA-free: the CPU-only build includes it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace pagedkv::kernels {

constexpr int kPeerMaxRanks = 8;
// Every launch has this many thread blocks, whatever its rows: block b's epoch counter advances
// once per launch on every rank, so the ranks' counters stay equal (see the .cu).
constexpr int kPeerBlocks = 32;
// What an empty element of a data slot holds: every byte 0xff, a NaN in float32, float16 and
// bfloat16 alike. A writer sends this one NaN as another NaN, so a slot element is ready exactly
// when it no longer holds the marker: no separate flag, no fence, one one-way trip over NVLink.
constexpr unsigned char kPeerEmptyByte = 0xff;

// One rank's buffer: [epochs | slots].
//   epochs [kPeerBlocks] uint32, zeroed: this rank's launches per block (only this rank touches it).
//   slots [2][world_size][data_bytes], every byte kPeerEmptyByte at first: slots[e % 2][s] holds
//       what rank s sent this rank at epoch e (rank s writes it; this rank reads and empties it).
//       Two epochs alternate: a rank can be at most one epoch ahead of a peer (it needs the
//       peer's data of its current epoch to finish it).
struct PeerBufferLayout {
  static constexpr size_t kEpochsOffset = 0;
  static constexpr size_t kDataOffset = 4096;  // 16-byte aligned, after the epochs
  static constexpr size_t bytes(size_t data_bytes, int world_size) {
    return kDataOffset + 2 * static_cast<size_t>(world_size) * data_bytes;
  }
  static constexpr size_t slot(uint32_t epoch, int source, size_t data_bytes, int world_size) {
    return kDataOffset + ((epoch & 1u) * static_cast<size_t>(world_size) + source) * data_bytes;
  }
};

}  // namespace pagedkv::kernels
