// 4-bit weight skinny GEMM on tensor cores for 1..8 rows of x, for int4 (zero point + scale per
// group) and NF4 (codebook + absmax per block): out^T[n, m] = W[n, k] x^T with mma.sync.m16n8k16
// (A = 16 weight rows x 16 k dequantized to x's dtype, B = 16 k x 8 rows of x zero-padded, C fp32).
//
// Why not the CUDA-core skeleton (gemv_dequant.cuh) at these sizes: there each 4-bit value costs
// an int-to-float conversion (a quarter-rate instruction on Hopper) or a table load, a multiply and
// one FMA per row of x, and the SMs run out of issue slots at ~40% of the memory bandwidth at
// batch 1 and far below at batch 8. Here the tensor cores do every multiply-add whatever the rows,
// and int4 pairs dequantize with no conversion at all, two values a register in three
// instructions (half_pairs.cuh's int4_pair).
// NF4 pairs are two codebook loads from shared memory times the absmax in fp32, rounded once to T.
// Int4 groups of 128 << j k (Int4GroupStepFormat) go further: a step then lies in one group, so
// the tensor cores take q - z unscaled and the scale multiplies each step's fp32 sums.
//
// Fragment order (as gemv_mma.cu: a dot product's k order is free, so any bijection of k onto the
// fragment slots that A and B share will do): lane (g = lane / 4, t = lane % 4) loads the 16 bytes
// = 32 k of weight rows g and g + 8 starting at k0 = 128 step + 32 t. Each 32-bit word j of the
// piece gives four A registers ("pairs" s = 0..3, the format says which two k each holds); the B
// register for the same slots is x[g] at those two k. Pairs s = 0, 1 feed one mma (slots 2t.. and
// 2t + 8..), s = 2, 3 the next: 8 mma per 16-byte piece of each of the two rows. A CTA owns 16
// weight rows; its kSplit warps share k (steps of 128) and reduce through shared memory at the end.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/gemv_4bit_mma.h"
#include "kernels/gemv_split_k.cuh"
#include "kernels/half_pairs.cuh"
#include "kernels/mma.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kStepK = 128;  // k per step: 4 lanes (t) x 32 int4 values

// Int4 with a zero point and a scale per group: pair s (0..3) of a word = nibbles s and s + 4,
// i.e. k (8j + s, 8j + s + 4); x's matching pair takes one byte permute.
template <typename T>
struct Int4Format {
  const T* scales;       // [n, groups]
  const uint8_t* zeros;  // [n, groups]
  int group_size;

  struct Piece {  // one row's group constants, as 16-bit pairs
    uint32_t zero2, scale2;
    __device__ __forceinline__ uint32_t pair(uint32_t word, int s) const {
      return int4_pair<T>(word, s, zero2, scale2);
    }
  };
  __device__ __forceinline__ Piece piece(int row, int groups, int p) const {
    const int64_t at = static_cast<int64_t>(row) * groups + p * 32 / group_size;
    return {broadcast2<T>(static_cast<T>(Magic<T>::kValue + __ldg(zeros + at))), broadcast2<T>(scales[at])};
  }
  __device__ __forceinline__ int groups(int k) const { return k / group_size; }
  static __device__ __forceinline__ uint32_t x_pair(const uint4& xv, int s) {
    const uint32_t lo = s < 2 ? xv.x : xv.y;  // k 8j + s is in word s / 2
    const uint32_t hi = s < 2 ? xv.z : xv.w;  // k 8j + s + 4 in word 2 + s / 2
    return __byte_perm(lo, hi, s % 2 == 0 ? 0x5410 : 0x7632);
  }
};

// Int4Format where every step lies in one group (group_size = 128 << j, AWQ's and GPTQ's usual
// 128 among them): the group's scale then multiplies the step's fp32 sums (4 FMAs a lane) instead
// of every weight pair (32 HMUL2s), and the tensor cores take q - z unscaled. bf16 goes one
// step further: A = M + q straight from the lop3, and the zero enters as one more mma a pair of
// slices, A = -(M + z) on the same x, in place of 32 HSUB2s a step (8 mma issue slots instead).
// Nothing is rounded but the fp32 sums, so the result is nearer the exact product than the
// dequantize-then-multiply reference; what the M + q form costs is cancellation, ~M x 2^-23 of
// sum |x| a step: ~1.5e-5 for bf16's M = 128, below its 2^-9 weight rounding by 100x. fp16's
// M = 1024 would lose 8x more, so fp16 subtracts M + z in halves first (exact) and skips the mma.
template <typename T>
struct Int4GroupStepFormat {
  const T* scales;       // [n, groups]
  const uint8_t* zeros;  // [n, groups]
  int piece_shift;       // log2(group_size / 32): piece p is in group p >> piece_shift

  struct Piece {
    static constexpr bool kZeroByMma = std::is_same_v<T, __nv_bfloat16>;
    static constexpr bool kSumsX = false;
    uint32_t zero2;  // kZeroByMma: (-(M + z), -(M + z)), the zero mma's A; else (M + z, M + z)
    float scale;
    __device__ __forceinline__ uint32_t pair(uint32_t word, int s) const {
      const uint32_t m_plus_q = lop3_and_or(word >> (4 * s), 0x000F000Fu, Magic<T>::kBits * 0x00010001u);
      if constexpr (kZeroByMma) {
        return m_plus_q;
      } else {
        return sub2<T>(m_plus_q, zero2);
      }
    }
  };
  __device__ __forceinline__ Piece piece(int row, int groups, int p) const {
    const int64_t at = static_cast<int64_t>(row) * groups + (p >> piece_shift);
    const uint32_t zero2 = magic_zero2<T>(__ldg(zeros + at));
    return {Piece::kZeroByMma ? zero2 | 0x80008000u : zero2, to_float(scales[at])};
  }
  __device__ __forceinline__ int groups(int k) const { return (k / 32) >> piece_shift; }
  static __device__ __forceinline__ uint32_t x_pair(const uint4& xv, int s) { return Int4Format<T>::x_pair(xv, s); }
};

// Int4 with a scale and a float zero per group, torchao's tinygemm form: w = (q - 8) * s + z,
// rounded once to T by one fused multiply-add as tinygemm's own dequantization does (__hfma2):
// the same pairs as Int4Format, then (M + q) - (M + 8) = q - 8 exactly and one hfma2.
template <typename T>
struct Int4OffsetFormat {
  const T* scales;  // [n, groups]
  const T* zeros;   // [n, groups]: added after scaling
  int group_size;

  struct Piece {
    uint32_t zero2, scale2;
    __device__ __forceinline__ uint32_t pair(uint32_t word, int s) const {
      const uint32_t magic2 = Magic<T>::kBits | (Magic<T>::kBits << 16);
      const uint32_t centre2 = broadcast2<T>(static_cast<T>(Magic<T>::kValue + 8.f));
      return fma2<T>(sub2<T>(lop3_and_or(word >> (4 * s), 0x000F000Fu, magic2), centre2), scale2, zero2);
    }
  };
  __device__ __forceinline__ Piece piece(int row, int groups, int p) const {
    const int64_t at = static_cast<int64_t>(row) * groups + p * 32 / group_size;
    return {broadcast2<T>(zeros[at]), broadcast2<T>(scales[at])};
  }
  __device__ __forceinline__ int groups(int k) const { return k / group_size; }
  static __device__ __forceinline__ uint32_t x_pair(const uint4& xv, int s) { return Int4Format<T>::x_pair(xv, s); }
};

// Int4OffsetFormat where every step lies in one group (Int4GroupStepFormat's condition): the sum
// over a group of w x = s sum (q - 8) x + z sum x, so the mma takes q - 8 unscaled (bf16: M + q
// straight from the lop3, M + 8 moved into the coefficient of sum x) and a second mma with A = 1
// gives sum x; a step then ends in c += s sums + coefficient x_sums, nothing rounded but fp32.
template <typename T>
struct Int4OffsetGroupStepFormat {
  const T* scales;  // [n, groups]
  const T* zeros;   // [n, groups]: added after scaling
  int piece_shift;  // log2(group_size / 32)

  struct Piece {
    static constexpr bool kZeroByMma = false;
    static constexpr bool kSumsX = true;
    static constexpr bool kRawMagic = std::is_same_v<T, __nv_bfloat16>;  // A = M + q, as Int4GroupStepFormat
    float scale;
    float x_coefficient;  // z, less s (M + 8) where A = M + q
    __device__ __forceinline__ uint32_t pair(uint32_t word, int s) const {
      const uint32_t m_plus_q = lop3_and_or(word >> (4 * s), 0x000F000Fu, Magic<T>::kBits * 0x00010001u);
      if constexpr (kRawMagic) {
        return m_plus_q;
      } else {
        return sub2<T>(m_plus_q, magic_zero2<T>(8));  // q - 8, exact
      }
    }
  };
  __device__ __forceinline__ Piece piece(int row, int groups, int p) const {
    const int64_t at = static_cast<int64_t>(row) * groups + (p >> piece_shift);
    const float scale = to_float(scales[at]);
    const float offset = Piece::kRawMagic ? Magic<T>::kValue + 8.f : 0.f;
    return {scale, fmaf(-scale, offset, to_float(zeros[at]))};
  }
  __device__ __forceinline__ int groups(int k) const { return (k / 32) >> piece_shift; }
  static __device__ __forceinline__ uint32_t x_pair(const uint4& xv, int s) { return Int4Format<T>::x_pair(xv, s); }
};

// NF4 (bitsandbytes): pair s of a word = byte s, k (8j + 2s, 8j + 2s + 1) in its high and low
// nibble; each value the codebook's entry times the block's absmax in fp32, rounded once to T
// (bitsandbytes' dequantize_4bit). x's matching pair is x's word s as loaded.
template <typename T>
struct Nf4Format {
  const float* absmax;  // [n, blocks]
  const float* code;    // [16], copied to shared memory per CTA
  int block_size;

  struct Piece {
    float scale;
    const float* codebook;  // shared memory
    __device__ __forceinline__ uint32_t pair(uint32_t word, int s) const {
      const uint32_t byte = word >> (8 * s);
      return pack2(codebook[(byte >> 4) & 0xFu] * scale, codebook[byte & 0xFu] * scale, T{});
    }
  };
  const float* shared_code;
  __device__ __forceinline__ Piece piece(int row, int blocks, int p) const {
    return {__ldg(absmax + static_cast<int64_t>(row) * blocks + p * 32 / block_size), shared_code};
  }
  __device__ __forceinline__ int groups(int k) const { return k / block_size; }
  static __device__ __forceinline__ uint32_t x_pair(const uint4& xv, int s) {
    return s == 0 ? xv.x : s == 1 ? xv.y : s == 2 ? xv.z : xv.w;
  }
};

// out [m, n] = x [m, k] @ W^T. packed: [n, k / 32] 16-byte pieces of 32 4-bit values; F: the
// format's constants (Int4Format, Nf4Format).
template <typename T, typename F, int kUnroll, int kSplit>
__global__ void __launch_bounds__(kSplit * 32)
    gemv_4bit_mma_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                         const uint4* __restrict__ packed, F format, int m, int n, int k) {
  begin_dependent_kernel();
  __shared__ float partial[kSplit - 1][4][32];
  __shared__ float code[16];
  if constexpr (std::is_same_v<F, Nf4Format<T>>) {
    if (threadIdx.x < 16) code[threadIdx.x] = format.code[threadIdx.x];
    __syncthreads();
    format.shared_code = code;
  }
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int tile = blockIdx.x;
  const int pieces = k / 32;
  const int groups = format.groups(k);
  const int row_lo = min(tile * 16 + g, n - 1);  // rows past n are read (clamped), not stored
  const int row_hi = min(tile * 16 + g + 8, n - 1);
  const uint4* w_lo = packed + static_cast<int64_t>(row_lo) * pieces;
  const uint4* w_hi = packed + static_cast<int64_t>(row_hi) * pieces;
  // Lanes of x rows past m read row 0 and zero it: a select, not a branch.
  const uint32_t x_mask = g < m ? ~0u : 0u;
  const T* x_row = x + static_cast<int64_t>(g < m ? g : 0) * x_stride;

  float c[4] = {0.f, 0.f, 0.f, 0.f};
  const int steps = (k + kStepK - 1) / kStepK;
  // Piece p of both rows times x. Every lane of the warp takes part in each mma; a lane whose
  // piece lies past k (k % 128 != 0) multiplies zeros of x (a zero word need not dequantize to 0).
  using Piece = typename F::Piece;
  // Scaled sums (Int4GroupStepFormat): every piece lies inside k (k % 128 == 0), and x rows past
  // m need no zeroing either: they feed only C columns >= m, which are never stored.
  const auto multiply_scaled = [&](const uint4& lo, const uint4& hi, int p, const auto& piece_lo,
                                   const auto& piece_hi) {  // a template: instantiated for F's with scaled sums only
    const uint32_t lo_words[4] = {lo.x, lo.y, lo.z, lo.w};
    const uint32_t hi_words[4] = {hi.x, hi.y, hi.z, hi.w};
    using StepPiece = std::decay_t<decltype(piece_lo)>;
    const uint4* xv_ptr = reinterpret_cast<const uint4*>(x_row + static_cast<int64_t>(p) * 32);
    float sums[4] = {0.f, 0.f, 0.f, 0.f};    // this step's sum of (q - z) x, one group's
    float x_sums[4] = {0.f, 0.f, 0.f, 0.f};  // kSumsX: its sum of x (the same for both rows)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 xv = xv_ptr[j];
#pragma unroll
      for (int s = 0; s < 4; s += 2) {
        const uint32_t a[4] = {piece_lo.pair(lo_words[j], s), piece_hi.pair(hi_words[j], s),
                               piece_lo.pair(lo_words[j], s + 1), piece_hi.pair(hi_words[j], s + 1)};
        const uint32_t b0 = F::x_pair(xv, s), b1 = F::x_pair(xv, s + 1);
        mma16816(sums, a, b0, b1, T{});
        if constexpr (StepPiece::kZeroByMma) {
          const uint32_t zero_a[4] = {piece_lo.zero2, piece_hi.zero2, piece_lo.zero2, piece_hi.zero2};
          mma16816(sums, zero_a, b0, b1, T{});
        }
        if constexpr (StepPiece::kSumsX) {
          constexpr uint32_t kOne2 = std::is_same_v<T, __nv_bfloat16> ? 0x3F803F80u : 0x3C003C00u;
          const uint32_t ones[4] = {kOne2, kOne2, kOne2, kOne2};
          mma16816(x_sums, ones, b0, b1, T{});
        }
      }
    }
    c[0] = fmaf(piece_lo.scale, sums[0], c[0]);  // C rows g (the lo weight row) and g + 8 (hi)
    c[1] = fmaf(piece_lo.scale, sums[1], c[1]);
    c[2] = fmaf(piece_hi.scale, sums[2], c[2]);
    c[3] = fmaf(piece_hi.scale, sums[3], c[3]);
    if constexpr (StepPiece::kSumsX) {
      c[0] = fmaf(piece_lo.x_coefficient, x_sums[0], c[0]);
      c[1] = fmaf(piece_lo.x_coefficient, x_sums[1], c[1]);
      c[2] = fmaf(piece_hi.x_coefficient, x_sums[2], c[2]);
      c[3] = fmaf(piece_hi.x_coefficient, x_sums[3], c[3]);
    }
  };
  const auto multiply = [&](const uint4& lo, const uint4& hi, int p, const Piece& piece_lo, const Piece& piece_hi) {
    const bool inside = p < pieces;
    const uint32_t mask = inside ? x_mask : 0u;
    p = inside ? p : 0;
    const uint32_t lo_words[4] = {lo.x, lo.y, lo.z, lo.w};
    const uint32_t hi_words[4] = {hi.x, hi.y, hi.z, hi.w};
    const uint4* xv_ptr = reinterpret_cast<const uint4*>(x_row + static_cast<int64_t>(p) * 32);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint4 xv = xv_ptr[j];
      xv = make_uint4(xv.x & mask, xv.y & mask, xv.z & mask, xv.w & mask);
#pragma unroll
      for (int s = 0; s < 4; s += 2) {
        const uint32_t a[4] = {piece_lo.pair(lo_words[j], s), piece_hi.pair(hi_words[j], s),
                               piece_lo.pair(lo_words[j], s + 1), piece_hi.pair(hi_words[j], s + 1)};
        mma16816(c, a, F::x_pair(xv, s), F::x_pair(xv, s + 1), T{});
      }
    }
  };
  const auto load = [&](const uint4* row, int p) {
    return p < pieces ? load16_stream(row + p) : make_uint4(0, 0, 0, 0);
  };

  // Warp w takes steps w, w + kSplit, ... in chunks of kUnroll, every load of a chunk in flight
  // before its first mma, the group constants (scale and zero, or absmax) with the weights: loaded
  // at their first use they were a second memory round trip a chunk. A chunk's steps past the end
  // load nothing and multiply zeros, so the last chunk costs one round trip too.
  for (int base = warp; base < steps; base += kUnroll * kSplit) {
    uint4 lo[kUnroll], hi[kUnroll];
    Piece piece_lo[kUnroll], piece_hi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = 4 * (base + u * kSplit) + t;
      lo[u] = load(w_lo, p);
      hi[u] = load(w_hi, p);
      piece_lo[u] = format.piece(row_lo, groups, p < pieces ? p : 0);
      piece_hi[u] = format.piece(row_hi, groups, p < pieces ? p : 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int step = base + u * kSplit;
      if constexpr (std::is_same_v<F, Int4GroupStepFormat<T>> || std::is_same_v<F, Int4OffsetGroupStepFormat<T>>) {
        if (step < steps) multiply_scaled(lo[u], hi[u], 4 * step + t, piece_lo[u], piece_hi[u]);  // warp-uniform
      } else {
        multiply(lo[u], hi[u], 4 * step + t, piece_lo[u], piece_hi[u]);
      }
    }
  }

  store_split_k_tile<T, kSplit>(c, partial, out, tile, m, n);
}

// The launch: kUnroll (128-k steps each warp has in flight, with their group constants) against
// kSplit (warps sharing a 16-row tile), picked by the tile count. Measured on the W1 shapes
// (benchmarks/bench_quant_linear.py, H100; lab/measurements.md, session 31): a matrix of few tiles
// (<= 2 an SM: W1's o and down projections, 224 tiles) fills the SMs only with 16 warps a tile,
// one step each in flight at 50 registers; int4 with up to 4 tiles an SM (qkv) is fastest at
// 8 warps x 4 steps, larger ones (gate/up) at 8 x 2 (64 registers: 4 CTAs an SM, where 4 steps'
// 74 allow 3). NF4's codebook lookups make it issue-bound sooner: one step in flight throughout.
// Int4 with float zeros (torchao) keeps 2 steps past 2 tiles an SM (not measured apart yet).
// Int4GroupStepFormat: 1 x 16 up to 2 tiles an SM, 2 x 8 past 4 (W1's gate/up: 32.0 -> 28.4 us
// at 1 row against Int4Format's plan, H200, session 41); 2-4 tiles an SM stay with Int4Format.
template <template <typename> class F, typename Make>
cudaError_t launch(void* out, const void* x, int64_t x_stride, const void* packed, int m, int n,
                   int k, int num_sms, DType dtype, cudaStream_t stream, Make make_format) {
  if (m == 0 || n == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    using T = decltype(tag);
    if constexpr (sizeof(T) != 2) {
      return cudaErrorInvalidValue;
    } else {
      const int tiles = (n + 15) / 16;
      const auto go = [&]<int kUnroll, int kSplit>() {
        launch_dependent(gemv_4bit_mma_kernel<T, F<T>, kUnroll, kSplit>, tiles, kSplit * 32, 0, stream,
                         static_cast<T*>(out), static_cast<const T*>(x), x_stride,
                         static_cast<const uint4*>(packed), make_format(tag), m, n, k);
        return cudaGetLastError();
      };
      if (tiles <= 2 * num_sms) return go.template operator()<1, 16>();
      if constexpr (std::is_same_v<F<T>, Int4GroupStepFormat<T>> || std::is_same_v<F<T>, Int4OffsetGroupStepFormat<T>>) {
        return go.template operator()<2, 8>();
      } else if constexpr (std::is_same_v<F<T>, Int4Format<T>>) {
        if (tiles <= 4 * num_sms) return go.template operator()<4, 8>();
        return go.template operator()<2, 8>();
      } else if constexpr (std::is_same_v<F<T>, Int4OffsetFormat<T>>) {
        return go.template operator()<2, 8>();  // 4 steps in flight spill 3 registers (the zero pairs)
      } else {
        return go.template operator()<1, 8>();
      }
    }
  });
}

}  // namespace

bool quant_mma_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("PAGEDKV_QUANT_MMA");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

cudaError_t gemv_w4a16_mma(void* out, const void* x, int64_t x_stride, const int32_t* packed,
                           const void* scales, const void* zeros, bool float_zeros, int m, int n, int k,
                           int group_size, int num_sms, DType dtype, cudaStream_t stream) {
  if (m > 8 || group_size <= 0 || group_size % 32 != 0 || k % group_size != 0) return cudaErrorInvalidValue;
  // Scaled sums where each step lies in one group, except for 2-4 tiles an SM (W1's qkv): there
  // Int4Format's 4 steps in flight fit 3 CTAs an SM (74 registers) where the scaled sums' need 86
  // and leave a second wave; its 2 steps were slower than Int4Format's 4 too (H200: 7.3 us
  // against 9.2 and 7.9 at 1 row; lab/measurements.md, session 41).
  const int pieces_per_group = group_size / 32;
  const int tiles = (n + 15) / 16;
  const bool qkv_like = tiles > 2 * num_sms && tiles <= 4 * num_sms;
  if (!float_zeros && group_size % kStepK == 0 && (pieces_per_group & (pieces_per_group - 1)) == 0 && !qkv_like) {
    return launch<Int4GroupStepFormat>(out, x, x_stride, packed, m, n, k, num_sms, dtype, stream, [&](auto tag) {
      using T = decltype(tag);
      return Int4GroupStepFormat<T>{static_cast<const T*>(scales), static_cast<const uint8_t*>(zeros),
                                    __builtin_ctz(pieces_per_group)};
    });
  }
  if (float_zeros && group_size % kStepK == 0 && (pieces_per_group & (pieces_per_group - 1)) == 0 && !qkv_like) {
    return launch<Int4OffsetGroupStepFormat>(out, x, x_stride, packed, m, n, k, num_sms, dtype, stream, [&](auto tag) {
      using T = decltype(tag);
      return Int4OffsetGroupStepFormat<T>{static_cast<const T*>(scales), static_cast<const T*>(zeros),
                                          __builtin_ctz(pieces_per_group)};
    });
  }
  if (float_zeros) {
    return launch<Int4OffsetFormat>(out, x, x_stride, packed, m, n, k, num_sms, dtype, stream, [&](auto tag) {
      using T = decltype(tag);
      return Int4OffsetFormat<T>{static_cast<const T*>(scales), static_cast<const T*>(zeros), group_size};
    });
  }
  return launch<Int4Format>(out, x, x_stride, packed, m, n, k, num_sms, dtype, stream, [&](auto tag) {
    using T = decltype(tag);
    return Int4Format<T>{static_cast<const T*>(scales), static_cast<const uint8_t*>(zeros), group_size};
  });
}

cudaError_t gemv_nf4_mma(void* out, const void* x, int64_t x_stride, const uint8_t* packed,
                         const float* absmax, const float* code, int m, int n, int k,
                         int block_size, int num_sms, DType dtype, cudaStream_t stream) {
  if (m > 8 || block_size <= 0 || block_size % 32 != 0 || k % block_size != 0) return cudaErrorInvalidValue;
  return launch<Nf4Format>(out, x, x_stride, packed, m, n, k, num_sms, dtype, stream, [&](auto tag) {
    using T = decltype(tag);
    return Nf4Format<T>{absmax, code, block_size, nullptr};
  });
}

}  // namespace pagedkv::kernels
