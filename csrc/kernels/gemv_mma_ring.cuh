// The tensor-core GEMV for 3-8 rows (one n-tile), fed through shared memory: each warp's weight
// and x pieces go by cp.async into a ring of its own, ring_stages() deep, so the bytes in flight
// are bounded by shared memory (~100 KB a CTA, 2 CTAs an SM) instead of by registers (the
// register pipeline of gemv_mma.cu holds ~64 KB an SM, and ptxas interleaves its loads with the
// mmas). A lane copies and later reads back only its own 16-byte pieces ([stage][piece][lane]:
// conflict-free), so no barrier guards the ring: cp.async.wait_group alone orders each lane's
// copies before its reads. A warp takes kRingSlices neighbouring slices a stage: one whole
// 128-byte line of each weight row of the tile. Weights bypass L1 (.cg); x's pieces go through
// it (.ca): every CTA of an SM re-reads the same rows of x, and at 8 rows x is half the weight
// bytes (with x through L2 only, the 8-row step ran ~2% slower than the register kernel).
// Against the register kernel (H200, session 33, two alternating rounds): the W1 verification
// step of 5 rows 4.35 / 4.51 ms against 4.59 / 4.59, the 8-row decode step 4.47 / 4.63 against
// 4.73 / 4.55 (level).
#pragma once
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv_mma_common.cuh"
#include "kernels/mma.cuh"

namespace pagedkv::kernels::gemv_mma_detail {

constexpr int kRingSlices = 2;  // slices a warp takes per stage: one 128-byte line of each row
template <int kAcc, int kNT>
constexpr int ring_chunks() { return kRingSlices * (2 * kAcc + kNT); }  // 16-byte pieces a lane a stage
template <int kAcc, int kNT>
constexpr int ring_stages() { return (100 << 10) / (kSplit * ring_chunks<kAcc, kNT>() * 32 * 16); }
template <int kAcc, int kNT>
constexpr int ring_smem_bytes() { return kSplit * ring_stages<kAcc, kNT>() * ring_chunks<kAcc, kNT>() * 32 * 16; }

// Same contract as gemv_mma.cu's gemv_mma_kernel (kAct kNone: x @ W^T + bias; else act(gate) * up),
// persistent the same way: CTA i takes tiles i, i + gridDim.x, ..., and its warps' rings run on
// across them (the next tile's first stages are in flight while this tile reduces and stores).
// Dynamic shared memory: ring_smem_bytes<kAcc, kNT>().
template <typename T, GatedAct kAct, int kNT>
__global__ void __launch_bounds__(kSplit * 32)
    gemv_mma_ring_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                         const T* __restrict__ weight, const T* __restrict__ bias, int m, int n, int k) {
  begin_dependent_kernel();
  constexpr int kAcc = weight_rows_per_output(kAct);  // weight rows per output: 1, or gate and up
  constexpr int kStages = ring_stages<kAcc, kNT>();
  constexpr int kPer = 2 * kAcc + kNT;  // pieces a lane a slice: lo, hi per accumulator, x per n-tile
  constexpr int kChunks = kRingSlices * kPer;
  constexpr int kStep = kSplit * kRingSlices;  // slices a CTA step
  static_assert(kStages >= 3, "the ring needs 3 stages");
  extern __shared__ __align__(16) uint4 ring_smem[];
  __shared__ float partial[kSplit - 1][kAcc][kNT][4][32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int tiles = (n + 15) / 16;
  uint4* ring = ring_smem + warp * kStages * kChunks * 32 + lane;  // piece c of stage s: ring[(s kChunks + c) 32]

  uint32_t x_mask[kNT];
  const T* x_ptr[kNT];
  x_rows<T, kNT>(x, x_stride, m, lane, x_ptr, x_mask);
  const int full = k / kSlice;
  const int steps = full / kStep;

  // The stages this warp loads, in order: (tile, step) for its CTA's tiles blockIdx.x,
  // + gridDim.x, ...; past the last one only empty groups (the group count stays uniform).
  int issue_tile = blockIdx.x, issue_step = 0, issue_slot = 0;
  const auto issue_next = [&]() {
    if (steps > 0 && issue_tile < tiles) {
      uint4* dst = ring + issue_slot * kChunks * 32;
      const int row0 = issue_tile * 16;
      const int g = lane / 4, t = lane % 4;
#pragma unroll
      for (int u = 0; u < kRingSlices; ++u) {
        const int s = (issue_step * kStep + warp * kRingSlices + u) * kSlice;
#pragma unroll
        for (int a = 0; a < kAcc; ++a) {
          const int64_t base = static_cast<int64_t>(a) * n;
          const T* lo = weight + (base + min(row0 + g, n - 1)) * k + 8 * t + s;
          const T* hi = weight + (base + min(row0 + g + 8, n - 1)) * k + 8 * t + s;
          cp_async16(dst + (u * kPer + 2 * a) * 32, lo, true);
          cp_async16(dst + (u * kPer + 2 * a + 1) * 32, hi, true);
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          cp_async16_ca(dst + (u * kPer + 2 * kAcc + nt) * 32, x_ptr[nt] + s, x_mask[nt] != 0);
        }
      }
      if (++issue_step == steps) issue_step = 0, issue_tile += gridDim.x;
    }
    issue_slot = issue_slot + 1 == kStages ? 0 : issue_slot + 1;
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue_next();

  int slot = 0;
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    float c[kAcc][kNT][4];
    zero_accumulators(c);

#pragma unroll 1
    for (int step = 0; step < steps; ++step) {
      cp_async_wait<kStages - 2>();  // this lane's pieces of stage `slot` have landed
      uint4 f[kChunks];
      const uint4* src = ring + slot * kChunks * 32;
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) f[ch] = src[ch * 32];
      issue_next();  // into the slot read one step ago
      slot = slot + 1 == kStages ? 0 : slot + 1;
#pragma unroll
      for (int u = 0; u < kRingSlices; ++u)
#pragma unroll
        for (int a = 0; a < kAcc; ++a)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
            mma_slice<T>(c[a][nt], f[u * kPer + 2 * a], f[u * kPer + 2 * a + 1], f[u * kPer + 2 * kAcc + nt]);
    }
    leftover_slices<T, kAcc, kNT>(c, weight, x_ptr, x_mask, tile, n, k, steps * kStep, warp, lane);
    store_tile<T, kAct, kNT>(c, partial, out, bias, tile, m, n, warp, lane);
  }
  cp_async_wait<0>();
}

}  // namespace pagedkv::kernels::gemv_mma_detail
