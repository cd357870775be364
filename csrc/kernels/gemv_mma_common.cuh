// What the two tensor-core GEMV kernels share (gemv_mma.cu: registers; gemv_mma_ring.cuh:
// a shared-memory ring): the fragment mapping of a 32-wide k-slice, the slices past the last
// whole step, and the reduction and store of a 16-row tile.
//
// out^T[n, m] = W[n, k] x^T with mma.sync.m16n8k16 (A = 16 weight rows x 16 k, B = 16 k x 8 rows
// of x zero-padded, C fp32); past 8 rows a second n-tile (rows 8-15) reuses each A fragment. A
// dot product's k order is free, so each lane takes 16 contiguous bytes of its two weight rows
// and the fragments are filled in load order; x's B fragment uses the same k permutation, which
// makes it 16 contiguous bytes of one x row too. A CTA owns 16 weight rows (16 gate + 16 up rows
// for a gated activation); its kSplit warps share k and reduce through shared memory at the end.
#pragma once
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/silu.cuh"

namespace pagedkv::kernels::gemv_mma_detail {

constexpr int kSplit = 4;   // warps per CTA sharing one 16-row tile's k range
constexpr int kSlice = 32;  // k per slice: 4 lanes x 8 elements per weight row

// 16 bytes of weight, read once: non-coherent path, no L1 allocation (left to x; see gemv.cu).
__device__ __forceinline__ uint4 load_streaming(const void* p) {
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

// This lane's row of x in each n-tile (n-tile nt holds x rows 8 nt .. 8 nt + 7; the lane's is
// 8 nt + g), at k offset 8 t. Lanes of rows past m point at row 0 with a zero mask: a select, not
// a branch, so the compiler keeps every load of an unrolled step ahead of the mmas.
template <typename T, int kNT>
__device__ __forceinline__ void x_rows(const T* __restrict__ x, int64_t x_stride, int m, int lane,
                                       const T* (&ptr)[kNT], uint32_t (&mask)[kNT]) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const int row = 8 * nt + g;
    mask[nt] = row < m ? ~0u : 0u;
    ptr[nt] = x + static_cast<int64_t>(row < m ? row : 0) * x_stride + 8 * t;
  }
}

template <int kAcc, int kNT>
__device__ __forceinline__ void zero_accumulators(float (&c)[kAcc][kNT][4]) {
#pragma unroll
  for (int a = 0; a < kAcc; ++a)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[a][nt][i] = 0.f;
}

// The kSplit warps' partial sums of one tile reduced through shared memory by warp 0, which
// stores the tile (kAct kNone: plus bias; otherwise act(gate) * up). Ends with a barrier:
// `partial` is reused.
template <typename T, GatedAct kAct, int kNT, int kAcc = weight_rows_per_output(kAct)>
__device__ __forceinline__ void store_tile(float (&c)[kAcc][kNT][4], float (&partial)[kSplit - 1][kAcc][kNT][4][32],
                                           T* __restrict__ out, const T* __restrict__ bias, int tile, int m,
                                           int n, int warp, int lane) {
  const int g = lane / 4;
  const int t = lane % 4;
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
          if constexpr (kAct != GatedAct::kNone) {
            *dst = gated_mul<kAct>(from_float<T>(c[0][nt][2 * h + e]), from_float<T>(c[1][nt][2 * h + e]));
          } else {
            const float b = bias == nullptr ? 0.f : to_float(bias[col]);
            *dst = from_float<T>(c[0][nt][2 * h + e] + b);
          }
        }
      }
  }
  __syncthreads();  // `partial` is rewritten for the next tile
}

// The slices past the last whole CTA step (k not a multiple of kSplit steps' slices; a last
// partial slice of 8, 16 or 24 k): warp w takes slices first + w, + kSplit, ..., loaded directly.
template <typename T, int kAcc, int kNT>
__device__ __forceinline__ void leftover_slices(float (&c)[kAcc][kNT][4], const T* __restrict__ weight,
                                                const T* const (&x_ptr)[kNT], const uint32_t (&x_mask)[kNT],
                                                int tile, int n, int k, int first, int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int row0 = tile * 16;
  for (int sl = first + warp; sl * kSlice < k; sl += kSplit) {
    const int s = sl * kSlice;
    const bool in = s + 8 * t < k;  // k % 8 == 0: a lane's 8 elements are all in or all out
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4 x_s[kNT];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const uint4 v = in ? *reinterpret_cast<const uint4*>(x_ptr[nt] + s) : zero;
      x_s[nt] = make_uint4(v.x & x_mask[nt], v.y & x_mask[nt], v.z & x_mask[nt], v.w & x_mask[nt]);
    }
#pragma unroll
    for (int a = 0; a < kAcc; ++a) {
      const int64_t base = static_cast<int64_t>(a) * n;
      const uint4 w_l = in ? load_streaming(weight + (base + min(row0 + g, n - 1)) * k + 8 * t + s) : zero;
      const uint4 w_h = in ? load_streaming(weight + (base + min(row0 + g + 8, n - 1)) * k + 8 * t + s) : zero;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) mma_slice<T>(c[a][nt], w_l, w_h, x_s[nt]);
    }
  }
}

}  // namespace pagedkv::kernels::gemv_mma_detail
