// Skinny GEMM for 3..kGemvMmaMaxRows rows of x on tensor cores: out^T[n, m] = W[n, k] x^T with
// mma.sync.m16n8k16 (A = 16 weight rows x 16 k, B = 16 k x 8 rows of x zero-padded, C fp32);
// past 8 rows a second n-tile (rows 8-15) reuses each A fragment: one weight read, two mmas.
// Weight streaming without shared memory: a dot product's k order is free, so each lane loads
// 16 contiguous bytes of its two weight rows and the fragments are filled in load order; x's B
// fragment uses the same k permutation, which makes it 16 contiguous bytes of one x row too.
// A CTA owns 16 weight rows (16 gate + 16 up rows for silu); its kSplit warps share k (so qkv/o,
// 224-288 tiles, still get ~900-1150 warps) and reduce through shared memory at the end. Each warp
// takes kUnroll neighbouring 32-wide slices per step, so one warp's loads of a row cover whole
// 128-byte lines (DRAM is read in full lines, not 64-byte halves from two warps).
// x is read once per 16x32 weight tile, from L1.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv.h"
#include "kernels/silu.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kSplit = 4;   // warps per CTA sharing one 16-row tile's k range
constexpr int kUnroll = 4;  // 32-wide k-slices loaded per warp before the first mma
constexpr int kSlice = 32;  // k per slice: 4 lanes x 8 elements per weight row

__device__ __forceinline__ uint4 load_streaming(const void* p) {  // see gemv.cu
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// c += a * b, m16n8k16, row.col. PTX ISA fragment layout, g = lane / 4, t = lane % 4:
//   a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]   a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   c[0..1] = C[g][2t..2t+1]                          c[2..3] = C[g+8][2t..2t+1]
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// One 32-wide k-slice: lane (g, t) holds lo = W[g][s+8t .. s+8t+7], hi = W[g+8][same k] and
// xv = x[g][same k]. Two mma k-steps j = 0, 1 map fragment k slot 2t+h to k = s+8t+4j+h and slot
// 2t+8+h to k = s+8t+4j+2+h (h = 0, 1): a bijection onto the slice, the same for A and B.
template <typename T>
__device__ __forceinline__ void mma_slice(float (&c)[4], const uint4& lo, const uint4& hi,
                                          const uint4& xv) {
  mma<T>(c, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
  mma<T>(c, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
}

// kAcc = 1: out [m, n] = x @ weight^T + bias. kAcc = 2 (silu): weight [2n, k] is gate rows then
// up rows; out [m, n] = silu(x @ gate^T) * (x @ up^T), each product rounded to T first (HF).
// x [m, k] has row stride x_stride; k % 8 == 0. Rows of the tile past n are clamped (read, not
// stored); x rows past m and k past the end are zeros.
// Persistent: CTA i takes tiles i, i + gridDim.x, ... and the software pipeline runs across
// them: the last step of one tile issues the loads of the next tile's first step, so the
// reduction and the stores of a tile overlap memory reads, and no CTA starts from an empty pipe
// (with one tile per CTA, every CTA of every wave waited a full memory round trip first).
template <typename T, int kAcc, int kNT>
__global__ void __launch_bounds__(kSplit * 32)
    gemv_mma_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                    const T* __restrict__ weight, const T* __restrict__ bias, int m, int n, int k) {
  begin_dependent_kernel();
  __shared__ float partial[kSplit - 1][kAcc][kNT][4][32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int tiles = (n + 15) / 16;

  // This lane's two weight rows (per accumulator) in tile `tile`, at k offset 8 t.
  const auto rows_of = [&](int tile, const T* (&lo)[kAcc], const T* (&hi)[kAcc]) {
    const int row0 = tile * 16;
#pragma unroll
    for (int a = 0; a < kAcc; ++a) {
      const int64_t base = static_cast<int64_t>(a) * n;
      lo[a] = weight + (base + min(row0 + g, n - 1)) * k + 8 * t;
      hi[a] = weight + (base + min(row0 + g + 8, n - 1)) * k + 8 * t;
    }
  };
  // Lanes of x rows past m read row 0 and zero it with a mask: a select, not a branch, so the
  // compiler keeps every load of an unrolled step ahead of the mmas.
  // n-tile nt holds x rows 8 nt .. 8 nt + 7; this lane's is row 8 nt + g.
  uint32_t x_mask[kNT];
  const T* x_ptr[kNT];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const int row = 8 * nt + g;
    x_mask[nt] = row < m ? ~0u : 0u;
    x_ptr[nt] = x + static_cast<int64_t>(row < m ? row : 0) * x_stride + 8 * t;
  }
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
#pragma unroll
    for (int a = 0; a < kAcc; ++a)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[a][nt][i] = 0.f;

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
    const T* w_lo[kAcc];
    const T* w_hi[kAcc];
    rows_of(tile, w_lo, w_hi);
    for (int sl = steps * kStep + warp; sl * kSlice < k; sl += kSplit) {  // leftover slices
      const int s = sl * kSlice;
      const bool in = s + 8 * t < k;  // k % 8 == 0: a lane's 8 elements are all in or all out
      const uint4 zero = make_uint4(0, 0, 0, 0);
      uint4 x_s[kNT];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) x_s[nt] = in ? load_x(nt, s) : zero;
#pragma unroll
      for (int a = 0; a < kAcc; ++a) {
        const uint4 w_l = in ? load_streaming(w_lo[a] + s) : zero;
        const uint4 w_h = in ? load_streaming(w_hi[a] + s) : zero;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mma_slice<T>(c[a][nt], w_l, w_h, x_s[nt]);
      }
    }

    if (warp > 0) {
#pragma unroll
      for (int a = 0; a < kAcc; ++a)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) partial[warp - 1][a][nt][i][lane] = c[a][nt][i];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
      for (int w = 0; w < kSplit - 1; ++w)
#pragma unroll
        for (int a = 0; a < kAcc; ++a)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) c[a][nt][i] += partial[w][a][nt][i][lane];

      // c[a][nt][2h + e] = out^T[16 tile + g + 8h][8 nt + 2t + e]: that output column, x row
      // 8 nt + 2t + e.
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = tile * 16 + g + 8 * h;
          if (col >= n) continue;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 8 * nt + 2 * t + e;
            if (i >= m) continue;
            T* dst = out + static_cast<int64_t>(i) * n + col;
            if constexpr (kAcc == 2) {
              *dst = silu_mul(from_float<T>(c[0][nt][2 * h + e]), from_float<T>(c[1][nt][2 * h + e]));
            } else {
              const float b = bias == nullptr ? 0.f : to_float(bias[col]);
              *dst = from_float<T>(c[0][nt][2 * h + e] + b);
            }
          }
        }
    }
    __syncthreads();  // `partial` is rewritten for the next tile
  }
}

// CTAs of gemv_mma_kernel<T, kAcc, kNT> resident on the whole GPU (occupancy times SMs), per device.
template <typename T, int kAcc, int kNT>
int resident_ctas() {
  static int cached[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 0;
  if (cached[device] == 0) {
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_mma_kernel<T, kAcc, kNT>, kSplit * 32, 0);
    cached[device] = std::max(1, sms * per_sm);
  }
  return cached[device];
}

// Tiles per CTA as even as the resident CTAs allow: ceil(tiles / resident) each, the grid the
// fewest CTAs that cover the tiles that way.
template <typename T, int kAcc, int kNT>
int persistent_grid(int tiles) {
  const int resident = resident_ctas<T, kAcc, kNT>();
  if (resident <= 0 || tiles <= resident) return tiles;
  const int per_cta = (tiles + resident - 1) / resident;
  return (tiles + per_cta - 1) / per_cta;
}

}  // namespace

cudaError_t gemv_mma(void* out, const void* x, int64_t x_stride, const void* weight,
                     const void* bias, int m, int n, int k, bool silu_mul, DType dtype,
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
      const int tiles = (n + 15) / 16;
      // One n-tile up to 8 rows (the kernel as it was), two past 8.
      const auto launch = [&](auto nt_tag) {
        constexpr int kNT = decltype(nt_tag)::value;
        if (silu_mul) {
          launch_dependent(gemv_mma_kernel<T, 2, kNT>, persistent_grid<T, 2, kNT>(tiles), kSplit * 32, 0, stream, o, xs, x_stride, w, nullptr, m, n, k);
        } else {
          launch_dependent(gemv_mma_kernel<T, 1, kNT>, persistent_grid<T, 1, kNT>(tiles), kSplit * 32, 0, stream, o, xs, x_stride, w, b, m, n, k);
        }
      };
      if (m <= 8) {
        launch(std::integral_constant<int, 1>{});
      } else {
        launch(std::integral_constant<int, 2>{});
      }
      return cudaGetLastError();
    }
  });
}

}  // namespace pagedkv::kernels
