// The tensor-core GEMV (csrc/kernels/gemv.h: gemv_mma) for kGemvMaxRows + 1 .. kGemvMmaMaxRows
// rows of x. Up to 8 rows (one n-tile) the ring kernel of gemv_mma_ring.cuh runs (on GPUs where
// two of its ~100 KB CTAs fit an SM: Hopper); 9-16 rows (two n-tiles: speculative verification
// steps on small matrices) and other GPUs the register-pipelined kernel below,
// where each warp takes kUnroll neighbouring 32-wide slices a step so one warp's loads of a row
// cover whole 128-byte lines, and x is read from L1. (The ring was measured at 3-8 rows only; at
// 9-16 rows the register kernel is what prompt lookup's 2.0x on SmolLM2 was measured with.)
// Fragment mapping and the tile's reduction: gemv_mma_common.cuh.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv.h"
#include "kernels/gemv_mma_common.cuh"
#include "kernels/gemv_mma_ring.cuh"

namespace pagedkv::kernels {
namespace {

using namespace gemv_mma_detail;

constexpr int kUnroll = 4;  // 32-wide k-slices loaded per warp before the first mma

// kAct kNone: out [m, n] = x @ weight^T + bias. kSilu, kGeluTanh: weight [2n, k] is gate rows
// then up rows; out [m, n] = act(x @ gate^T) * (x @ up^T), each product rounded to T first (HF).
// x [m, k] has row stride x_stride; k % 8 == 0. Rows of the tile past n are clamped (read, not
// stored); x rows past m and k past the end are zeros.
// Persistent: CTA i takes tiles i, i + gridDim.x, ... and the software pipeline runs across
// them: the last step of one tile issues the loads of the next tile's first step, so the
// reduction and the stores of a tile overlap memory reads, and no CTA starts from an empty pipe
// (with one tile per CTA, every CTA of every wave waited a full memory round trip first).
template <typename T, GatedAct kAct, int kNT>
__global__ void __launch_bounds__(kSplit * 32)
    gemv_mma_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                    const T* __restrict__ weight, const T* __restrict__ bias, int m, int n, int k) {
  begin_dependent_kernel();
  constexpr int kAcc = weight_rows_per_output(kAct);  // weight rows per output: 1, or gate and up
  __shared__ float partial[kSplit - 1][kAcc][kNT][4][32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int tiles = (n + 15) / 16;

  // This lane's two weight rows (per accumulator) in tile `tile`, at k offset 8 t.
  const auto rows_of = [&](int tile, const T* (&lo)[kAcc], const T* (&hi)[kAcc]) {
    const int g = lane / 4, t = lane % 4;
    const int row0 = tile * 16;
#pragma unroll
    for (int a = 0; a < kAcc; ++a) {
      const int64_t base = static_cast<int64_t>(a) * n;
      lo[a] = weight + (base + min(row0 + g, n - 1)) * k + 8 * t;
      hi[a] = weight + (base + min(row0 + g + 8, n - 1)) * k + 8 * t;
    }
  };
  uint32_t x_mask[kNT];
  const T* x_ptr[kNT];
  x_rows<T, kNT>(x, x_stride, m, lane, x_ptr, x_mask);
  auto load_x = [&](int nt, int s) -> uint4 {
    uint4 v = *reinterpret_cast<const uint4*>(x_ptr[nt] + s);
    return make_uint4(v.x & x_mask[nt], v.y & x_mask[nt], v.z & x_mask[nt], v.w & x_mask[nt]);
  };

  const int full = k / kSlice;  // whole slices; a partial one (8, 16 or 24 k) may follow
  constexpr int kStep = kSplit * kUnroll;  // slices per CTA step; warp w takes kUnroll of them
  const int steps = full / kStep;
  uint4 lo[kUnroll][kAcc], hi[kUnroll][kAcc], xv[kUnroll][kNT];
  auto load = [&](const T* const (&w_lo)[kAcc], const T* const (&w_hi)[kAcc], int step) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = (step * kStep + warp * kUnroll + u) * kSlice;
#pragma unroll
      for (int a = 0; a < kAcc; ++a) {
        lo[u][a] = load_streaming(w_lo[a] + s);
        hi[u][a] = load_streaming(w_hi[a] + s);
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) xv[u][nt] = load_x(nt, s);
    }
  };

  int tile = blockIdx.x;
  if (steps > 0) {
    const T* w_lo[kAcc];
    const T* w_hi[kAcc];
    rows_of(tile, w_lo, w_hi);
    load(w_lo, w_hi, 0);
  }
#pragma unroll 1
  for (; tile < tiles; tile += gridDim.x) {
    const int next_tile = tile + gridDim.x;

    float c[kAcc][kNT][4];
    zero_accumulators(c);

    // Main loop, software-pipelined by hand: the loads of the next step (or of the next tile's
    // first) are issued before the mmas of the current one (ptxas otherwise sinks each load
    // next to its mma). Past the last tile, the last prefetch re-reads the current slices (an
    // L2 hit) instead of branching.
#pragma unroll 1
    for (int step = 0; step < steps; ++step) {
      uint4 lo_c[kUnroll][kAcc], hi_c[kUnroll][kAcc], xv_c[kUnroll][kNT];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) xv_c[u][nt] = xv[u][nt];
#pragma unroll
        for (int a = 0; a < kAcc; ++a) {
          lo_c[u][a] = lo[u][a];
          hi_c[u][a] = hi[u][a];
        }
      }
      {  // after this tile's last step, the next tile's first; past the last tile, this step again
        const bool last = step + 1 == steps;
        const bool ahead = last && next_tile < tiles;
        const T* l_lo[kAcc];
        const T* l_hi[kAcc];
        rows_of(ahead ? next_tile : tile, l_lo, l_hi);
        load(l_lo, l_hi, ahead ? 0 : (last ? step : step + 1));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int a = 0; a < kAcc; ++a)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) mma_slice<T>(c[a][nt], lo_c[u][a], hi_c[u][a], xv_c[u][nt]);
    }
    leftover_slices<T, kAcc, kNT>(c, weight, x_ptr, x_mask, tile, n, k, steps * kStep, warp, lane);
    store_tile<T, kAct, kNT>(c, partial, out, bias, tile, m, n, warp, lane);
  }
}

// Whether two CTAs of the ring kernel (~100 KB of shared memory each) fit an SM of the current
// device, as on Hopper (228 KB an SM), where it was measured. Elsewhere (A100: 164 KB; sm_86 /
// sm_89, RTX 30xx / 40xx, A10, L4: 100 KB) the register kernel runs. Once per device.
template <int kAcc, int kNT>
bool ring_fits_device() {
  static int cached[64] = {};  // 0 unknown, 1 fits, 2 does not
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
  if (cached[device] == 0) {
    int per_sm = 0, per_block = 0;
    cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    constexpr int partial_bytes = (kSplit - 1) * kAcc * kNT * 4 * 32 * static_cast<int>(sizeof(float));
    constexpr int block_bytes = ring_smem_bytes<kAcc, kNT>() + partial_bytes;
    constexpr int reserved = 1024;  // the system's shared memory per CTA
    cached[device] = block_bytes <= per_block && 2 * (block_bytes + reserved) <= per_sm ? 1 : 2;
  }
  return cached[device] == 1;
}

// CTAs of the kernel resident on the whole GPU (occupancy times SMs), per device; for the ring
// kernel also lets it take its dynamic shared memory (once per device).
template <typename T, GatedAct kAct, int kNT, bool kRing>
int resident_ctas() {
  constexpr int kAcc = weight_rows_per_output(kAct);
  static int cached[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  if (cached[device] == 0) {
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if constexpr (kRing) {
      constexpr int smem = ring_smem_bytes<kAcc, kNT>();
      cudaFuncSetAttribute(gemv_mma_ring_kernel<T, kAct, kNT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_mma_ring_kernel<T, kAct, kNT>, kSplit * 32, smem);
    } else {
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_mma_kernel<T, kAct, kNT>, kSplit * 32, 0);
    }
    cached[device] = std::max(1, sms * per_sm);
  }
  return cached[device];
}

// Tiles per CTA as even as the resident CTAs allow: ceil(tiles / resident) each, the grid the
// fewest CTAs that cover the tiles that way.
template <typename T, GatedAct kAct, int kNT, bool kRing>
int persistent_grid(int tiles) {
  const int resident = resident_ctas<T, kAct, kNT, kRing>();
  if (resident <= 0 || tiles <= resident) return tiles;
  const int per_cta = (tiles + resident - 1) / resident;
  return (tiles + per_cta - 1) / per_cta;
}

// One n-tile: the ring kernel where it fits the device; otherwise the register kernel.
template <typename T, GatedAct kAct, int kNT>
void launch_mma(T* o, const T* xs, int64_t x_stride, const T* w, const T* b, int m, int n, int k,
                cudaStream_t stream) {
  constexpr int kAcc = weight_rows_per_output(kAct);
  const int tiles = (n + 15) / 16;
  if constexpr (kNT == 1) {
    if (ring_fits_device<kAcc, kNT>()) {
      launch_dependent(gemv_mma_ring_kernel<T, kAct, kNT>, persistent_grid<T, kAct, kNT, true>(tiles),
                       kSplit * 32, ring_smem_bytes<kAcc, kNT>(), stream, o, xs, x_stride, w, b, m, n, k);
      return;
    }
  }
  launch_dependent(gemv_mma_kernel<T, kAct, kNT>, persistent_grid<T, kAct, kNT, false>(tiles), kSplit * 32, 0,
                   stream, o, xs, x_stride, w, b, m, n, k);
}

}  // namespace

cudaError_t gemv_mma(void* out, const void* x, int64_t x_stride, const void* weight,
                     const void* bias, int m, int n, int k, GatedAct act, DType dtype,
                     cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  if (m > kGemvMmaMaxRows) return cudaErrorInvalidValue;
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;  // fp32 goes to cuBLAS (the launcher decides)
    } else {
      auto* o = static_cast<T*>(out);
      auto* xs = static_cast<const T*>(x);
      auto* w = static_cast<const T*>(weight);
      auto* b = static_cast<const T*>(bias);
      // One n-tile up to 8 rows, two past 8.
      const auto launch = [&](auto nt_tag) {
        return dispatch_gated_act(act, [&](auto act_tag) {
          launch_mma<T, decltype(act_tag)::value, decltype(nt_tag)::value>(o, xs, x_stride, w, b, m,
                                                                           n, k, stream);
          return cudaGetLastError();
        });
      };
      return m <= 8 ? launch(std::integral_constant<int, 1>{}) : launch(std::integral_constant<int, 2>{});
    }
  });
}

}  // namespace pagedkv::kernels
