// NF4 skinny GEMM on tensor cores, 1..8 rows of x, for absmax blocks of 64 << j columns
// (bitsandbytes' default 64 among them): out^T[n, m] = W[n, k] x^T with mma.sync.m16n8k16, the
// absmax applied to each block's fp32 sums instead of every weight.
//
// Why not gemv_4bit_mma.cu's Nf4Format: there each pair of codes costs two codebook loads from
// shared memory, two multiplies by the absmax and a packing conversion; the loads alone are 64
// shared-memory wavefronts a 128-k step of 16 rows (1 KB of weights) next to ~20 for x and the
// weights, past what one SM's load pipe moves in the time its share of the copy bandwidth brings
// 1 KB (NF4 ran at 45% of it, session 34). Here one load gives a byte's pair of codes already in
// x's dtype, from a 256-entry table held once per lane column of shared memory (32 copies: lane l
// reads copy l, in bank l, so the lookups of a warp never conflict): 32 loads a step, no multiply
// and no conversion.
//
// What that needs: an mma takes its 16 k from all four lanes t of a row group, so all 16 must
// share one absmax. Lane t therefore loads 8 bytes = 16 codes from each 32-byte half of a step's
// 64 bytes of a row (bytes 32 h + 8 t): half h is one 64-k block (or part of a larger one), and
// the two mma of each 8-byte word stay inside it. A block's sums are scaled by its absmax once.
// The codes are rounded to T (x's dtype) and the absmax multiplies in fp32: the weights are
// rounded where bitsandbytes rounds code * absmax, an error of the same size (2^-9 relative for
// bf16), and nothing else is.
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv_4bit_mma.h"
#include "kernels/gemv_split_k.cuh"
#include "kernels/mma.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kStepK = 128;     // k per step: 4 lanes x 2 halves x 16 codes
constexpr int kHalfBytes = 32;  // one half of a row's 64 bytes a step: 64 codes

__device__ __forceinline__ uint2 load8_stream(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// out [m, n] = x [m, k] @ W^T. packed: [n, k / 2] bytes (column 2b in the high nibble of byte b);
// absmax: [n, k / block_size] fp32; code: [16] fp32; block_shift: log2(block_size / 64).
template <typename T, int kUnroll, int kSplit>
__global__ void __launch_bounds__(kSplit * 32)
    gemv_nf4_block_scaled_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                                 const uint8_t* __restrict__ packed, const float* __restrict__ absmax,
                                 const float* __restrict__ code, int block_shift, int m, int n, int k) {
  begin_dependent_kernel();
  __shared__ float partial[kSplit - 1][4][32];
  // pairs[b][l]: byte b's codes (high nibble in the low half) in T, copy l for lane l.
  __shared__ uint32_t pairs[256][32];
  for (int i = threadIdx.x; i < 256 * 8; i += kSplit * 32) {
    const int b = i / 8;
    const uint32_t pair = pack2(code[b >> 4], code[b & 15], T{});
    reinterpret_cast<uint4*>(pairs[b])[i % 8] = make_uint4(pair, pair, pair, pair);
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int tile = blockIdx.x;
  const int64_t row_bytes = k / 2;
  const int blocks = (k >> 6) >> block_shift;
  const int row_lo = min(tile * 16 + g, n - 1);  // rows past n are read (clamped), not stored
  const int row_hi = min(tile * 16 + g + 8, n - 1);
  const uint8_t* w_lo = packed + row_lo * row_bytes + 8 * t;
  const uint8_t* w_hi = packed + row_hi * row_bytes + 8 * t;
  const float* absmax_lo = absmax + static_cast<int64_t>(row_lo) * blocks;
  const float* absmax_hi = absmax + static_cast<int64_t>(row_hi) * blocks;
  // x rows past m read row 0: they feed only C columns >= m, which are never stored.
  const T* x_row = x + static_cast<int64_t>(g < m ? g : 0) * x_stride + 16 * t;
  // Byte s of a word, looked up: pairs[b][lane] lies 128 b bytes past pairs[0][lane], so one
  // shift puts b at bit 7, one and masks it, one add and a shared load (4 instructions).
  uint32_t lane_pairs;  // through an asm: the compiler rebuilt the address in the loop
  asm volatile("mov.b32 %0, %1;" : "=r"(lane_pairs)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(&pairs[0][lane]))));
  const auto pair_of = [&](uint32_t word, int s) {
    const uint32_t at = lane_pairs + ((s == 0 ? word << 7 : word >> (8 * s - 7)) & 0x7F80u);
    uint32_t pair;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(pair) : "r"(at));
    return pair;
  };

  float c[4] = {0.f, 0.f, 0.f, 0.f};
  const int halves = k / 64;  // 64-k halves of steps inside k (k % 64 == 0)
  const int steps = (halves + 1) / 2;
  // Half h of a step: 8 bytes of each row, 16 codes = k 64 h + 16 t + (0..15) of the step, and
  // x at the same k. Two words a row, two mma a word.
  const auto multiply_half = [&](const uint2& lo, const uint2& hi, int step, int h, float scale_lo, float scale_hi) {
    const uint4* xv_ptr = reinterpret_cast<const uint4*>(x_row + static_cast<int64_t>(step) * kStepK + 64 * h);
    const uint32_t lo_words[2] = {lo.x, lo.y};
    const uint32_t hi_words[2] = {hi.x, hi.y};
    float sums[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint4 xv = xv_ptr[j];  // k 8j .. 8j + 7 of the lane's 16; word s = k 8j + 2s, + 1
      const uint32_t x_words[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
      for (int s = 0; s < 4; s += 2) {
        const uint32_t a[4] = {pair_of(lo_words[j], s), pair_of(hi_words[j], s), pair_of(lo_words[j], s + 1),
                               pair_of(hi_words[j], s + 1)};
        mma16816(sums, a, x_words[s], x_words[s + 1], T{});
      }
    }
    c[0] = fmaf(scale_lo, sums[0], c[0]);  // C rows g (the lo weight row) and g + 8 (hi)
    c[1] = fmaf(scale_lo, sums[1], c[1]);
    c[2] = fmaf(scale_hi, sums[2], c[2]);
    c[3] = fmaf(scale_hi, sums[3], c[3]);
  };

  // Warp w takes steps w, w + kSplit, ... in chunks of kUnroll, every load of a chunk (weights
  // and absmax) in flight before its first mma. Halves past k load nothing and are skipped.
  for (int base = warp; base < steps; base += kUnroll * kSplit) {
    uint2 lo[kUnroll][2], hi[kUnroll][2];
    float scale_lo[kUnroll][2], scale_hi[kUnroll][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int half = 2 * (base + u * kSplit) + h;
        if (half < halves) {
          lo[u][h] = load8_stream(w_lo + half * kHalfBytes);
          hi[u][h] = load8_stream(w_hi + half * kHalfBytes);
          scale_lo[u][h] = __ldg(absmax_lo + (half >> block_shift));
          scale_hi[u][h] = __ldg(absmax_hi + (half >> block_shift));
        } else {
          lo[u][h] = hi[u][h] = make_uint2(0, 0);
          scale_lo[u][h] = scale_hi[u][h] = 0.f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int step = base + u * kSplit;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (2 * step + h < halves) multiply_half(lo[u][h], hi[u][h], step, h, scale_lo[u][h], scale_hi[u][h]);
      }
    }
  }

  store_split_k_tile<T, kSplit>(c, partial, out, tile, m, n);
}

}  // namespace

// The launch as gemv_4bit_mma.cu's int4 scaled sums (their instruction counts are alike): 16
// warps a tile, one step each in flight, up to 2 tiles an SM; past that 8 warps x 2 steps.
cudaError_t gemv_nf4_block_scaled_mma(void* out, const void* x, int64_t x_stride, const uint8_t* packed,
                                      const float* absmax, const float* code, int m, int n, int k,
                                      int block_size, int num_sms, DType dtype, cudaStream_t stream) {
  const int blocks_per_64 = block_size / 64;
  if (m > 8 || block_size < 64 || block_size % 64 != 0 || (blocks_per_64 & (blocks_per_64 - 1)) != 0 ||
      k % block_size != 0) {
    return cudaErrorInvalidValue;
  }
  if (m == 0 || n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;
    } else {
      const int tiles = (n + 15) / 16;
      const auto go = [&]<int kUnroll, int kSplit>() {
        launch_dependent(gemv_nf4_block_scaled_kernel<T, kUnroll, kSplit>, tiles, kSplit * 32, 0, stream,
                         static_cast<T*>(out), static_cast<const T*>(x), x_stride, packed, absmax, code,
                         __builtin_ctz(blocks_per_64), m, n, k);
        return cudaGetLastError();
      };
      if (tiles <= 2 * num_sms) return go.template operator()<1, 16>();
      return go.template operator()<2, 8>();
    }
  });
}

}  // namespace pagedkv::kernels
