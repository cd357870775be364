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

// One rank's buffer: [flags | epochs | data area 0 | data area 1].
//   flags [kPeerBlocks][kPeerMaxRanks] uint32: flags[b][p] is the last epoch rank p's block b
//       announced to this rank (peers write it).
//   epochs [kPeerBlocks] uint32: this rank's launches per block (only this rank touches it).
//   data areas: the rows this rank contributes, alternating by epoch parity, so a rank that runs
//       one all-reduce ahead never overwrites what a slower peer is still reading.
struct PeerBufferLayout {
  static constexpr size_t kFlagsOffset = 0;
  static constexpr size_t kEpochsOffset = sizeof(uint32_t) * kPeerBlocks * kPeerMaxRanks;
  static constexpr size_t kDataOffset = 4096;  // 16-byte aligned, after flags + epochs
  static constexpr size_t bytes(size_t data_bytes) { return kDataOffset + 2 * data_bytes; }
};

}  // namespace pagedkv::kernels
