// Fused (per-head RMSNorm +) rotary embedding + KV-cache write. A group of G lanes (G a power of
// two <= 32, about two 16-byte chunks of the head per lane) owns one (token, head): q heads are
// rotated in place; k heads are rotated in place and, with v, written to their cache slot.
//
// Rounding follows HF so greedy tokens match: `q * cos + rotate_half(q) * sin` runs in the model
// dtype T with cos/sin cast to T, i.e. each product is rounded to T and their sum is rounded to
// T; fp32 uses __fmul_rn/__fadd_rn so no FMA contraction changes the rounding. The optional norm
// is HF's RMSNorm (Qwen3's q_norm/k_norm): normalize in fp32, round to T, times weight, round.
// The cache element type C is T, or __nv_fp8_e4m3 (K/V divided by their scale, clamped to
// +-448 and rounded to nearest even, as torch's .to(torch.float8_e4m3fn)); a T cache's code is
// the same as without the fp8 option (store_cache's other branch is compiled out).
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/rope_and_write_kv.h"

namespace pagedkv::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

template <typename T>
__device__ __forceinline__ float mul_round(float a, float b) { return round_to<T>(__fmul_rn(a, b)); }

// HF's RMSNorm of one element once the row's inverse RMS is known.
template <typename T>
__device__ __forceinline__ float rms_scale(float x, float inv_rms, T weight) {
  return mul_round<T>(to_float(weight), round_to<T>(__fmul_rn(x, inv_rms)));
}

// kVec elements of a K/V head into the cache: as they are (C == T), or as e4m3 of x / scale.
template <typename C, typename T, int kVec>
__device__ __forceinline__ void store_cache(C* dst, const Vec<T, kVec>& x, float scale) {
  if constexpr (std::is_same_v<C, T>) {
    *reinterpret_cast<Vec<T, kVec>*>(dst) = x;
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float y = fminf(fmaxf(__fdiv_rn(to_float(x.v[j]), scale), -448.f), 448.f);
      dst[j].__x = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

// Lanes [base, base + G) of the warp, where base is this lane's group start.
__device__ __forceinline__ unsigned group_mask(int group_size) {
  if (group_size == 32) return 0xffffffffu;
  const int base = (threadIdx.x % 32) & ~(group_size - 1);
  return ((1u << group_size) - 1) << base;
}

template <typename T, typename C, int kVec, bool kNorm>
__global__ void __launch_bounds__(kThreads) rope_and_write_kv_kernel(const RopeArgs a, int group_size) {
  begin_dependent_kernel();
  using V = Vec<T, kVec>;
  const int G = group_size;
  const int lane = threadIdx.x & (G - 1);
  const int heads = a.num_q_heads + a.num_kv_heads;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / G;
  // Every early return below is uniform over the group, so the group's shuffles stay complete.
  if (item >= static_cast<int64_t>(a.num_tokens) * heads) return;
  const int64_t token = item / heads;
  const int head = static_cast<int>(item % heads);
  const int pos = a.positions[token];
  // An out-of-range position is a caller bug (the CPU op raises): touch nothing rather than read
  // outside the cos/sin cache.
  if (pos < 0 || pos >= a.max_position) return;

  const bool is_q = head < a.num_q_heads;
  const int kv_head = head - a.num_q_heads;
  const int D = a.head_dim;
  const int64_t slot = a.slot_mapping[token];
  const bool write = !is_q && slot >= 0 && slot < a.num_slots;
  T* x = is_q ? static_cast<T*>(a.q) + token * a.q_stride + static_cast<int64_t>(head) * D
              : static_cast<T*>(a.k) + token * a.k_stride + static_cast<int64_t>(kv_head) * D;
  const int64_t cache_offset = (slot * a.num_kv_heads + kv_head) * D;
  C* k_out = write ? static_cast<C*>(a.k_cache) + cache_offset : nullptr;
  float k_scale = 1.f, v_scale = 1.f;  // read only for an fp8 cache
  if constexpr (!std::is_same_v<C, T>) {
    if (write) {
      k_scale = *a.k_scale;
      v_scale = *a.v_scale;
    }
  }
  const T* w = kNorm ? static_cast<const T*>(is_q ? a.q_norm_weight : a.k_norm_weight) : nullptr;
  const bool norm = kNorm && w != nullptr;
  const V* w_vec = reinterpret_cast<const V*>(w);

  float inv_rms = 1.f;
  if (norm) {
    float sum_sq = 0.f;
    for (int c = lane; c < D / kVec; c += G) {
      const V xv = reinterpret_cast<const V*>(x)[c];
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum_sq += to_float(xv.v[j]) * to_float(xv.v[j]);
    }
    // The shuffles also order every lane's reads above before any write below.
    const unsigned mask = group_mask(G);
    for (int offset = G / 2; offset > 0; offset >>= 1) {
      sum_sq += __shfl_xor_sync(mask, sum_sq, offset, G);
    }
    inv_rms = rsqrtf(__fdiv_rn(sum_sq, static_cast<float>(D)) + a.epsilon);
  }

  // Rotation: lane owns chunk c of the first half and the matching chunk of the second half.
  const int half = a.rot_dim / 2;
  const float* cos = a.cos_sin_cache + static_cast<int64_t>(pos) * a.rot_dim;
  const float* sin = cos + half;
  for (int c = lane; c < half / kVec; c += G) {
    const int i = c * kVec;
    V x1 = *reinterpret_cast<const V*>(x + i);
    V x2 = *reinterpret_cast<const V*>(x + half + i);
    V w1, w2;
    if (norm) {
      w1 = w_vec[c];
      w2 = w_vec[(half + i) / kVec];
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float a1 = to_float(x1.v[j]);
      float a2 = to_float(x2.v[j]);
      if (norm) {
        a1 = rms_scale(a1, inv_rms, w1.v[j]);
        a2 = rms_scale(a2, inv_rms, w2.v[j]);
      }
      const float cs = round_to<T>(cos[i + j]);
      const float sn = round_to<T>(sin[i + j]);
      x1.v[j] = from_float<T>(__fadd_rn(mul_round<T>(a1, cs), mul_round<T>(-a2, sn)));
      x2.v[j] = from_float<T>(__fadd_rn(mul_round<T>(a2, cs), mul_round<T>(a1, sn)));
    }
    *reinterpret_cast<V*>(x + i) = x1;
    *reinterpret_cast<V*>(x + half + i) = x2;
    if (write) {
      store_cache(k_out + i, x1, k_scale);
      store_cache(k_out + half + i, x2, k_scale);
    }
  }

  // Dimensions past rot_dim (partial rotary): normalized if asked, never rotated.
  if (norm || write) {
    for (int c = a.rot_dim / kVec + lane; c < D / kVec; c += G) {
      V xv = reinterpret_cast<const V*>(x)[c];
      if (norm) {
        const V wv = w_vec[c];
#pragma unroll
        for (int j = 0; j < kVec; ++j) xv.v[j] = from_float<T>(rms_scale(to_float(xv.v[j]), inv_rms, wv.v[j]));
        reinterpret_cast<V*>(x)[c] = xv;
      }
      if (write) store_cache(k_out + c * kVec, xv, k_scale);
    }
  }

  if (write) {
    const V* v_in = reinterpret_cast<const V*>(static_cast<const T*>(a.v) + token * a.v_stride +
                                               static_cast<int64_t>(kv_head) * D);
    C* v_out = static_cast<C*>(a.v_cache) + cache_offset;
    for (int c = lane; c < D / kVec; c += G) store_cache(v_out + c * kVec, v_in[c], v_scale);
  }
}

template <typename T, typename C>
cudaError_t launch(const RopeArgs& a, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorized =
      a.head_dim % kVec == 0 && (a.rot_dim / 2) % kVec == 0 && a.q_stride % kVec == 0 &&
      a.k_stride % kVec == 0 && a.v_stride % kVec == 0 && aligned16(a.q) && aligned16(a.k) &&
      aligned16(a.v) && aligned16(a.k_cache) && aligned16(a.v_cache) &&
      aligned16(a.q_norm_weight) && aligned16(a.k_norm_weight);  // nullptr counts as aligned
  const int chunks = a.head_dim / (vectorized ? kVec : 1);
  int group_size = 1;  // about two chunks per lane
  while (group_size < 32 && group_size * 4 <= chunks) group_size *= 2;
  const int64_t items = static_cast<int64_t>(a.num_tokens) * (a.num_q_heads + a.num_kv_heads);
  const int64_t items_per_block = kThreads / group_size;
  const dim3 grid(static_cast<unsigned>((items + items_per_block - 1) / items_per_block));
  const bool norm = a.q_norm_weight != nullptr || a.k_norm_weight != nullptr;
  if (vectorized) {
    if (norm) launch_dependent(rope_and_write_kv_kernel<T, C, kVec, true>, grid, kThreads, 0, stream, a, group_size);
    else launch_dependent(rope_and_write_kv_kernel<T, C, kVec, false>, grid, kThreads, 0, stream, a, group_size);
  } else {
    if (norm) launch_dependent(rope_and_write_kv_kernel<T, C, 1, true>, grid, kThreads, 0, stream, a, group_size);
    else launch_dependent(rope_and_write_kv_kernel<T, C, 1, false>, grid, kThreads, 0, stream, a, group_size);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope_and_write_kv(const RopeArgs& a, DType dtype, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    return a.k_scale != nullptr ? launch<T, __nv_fp8_e4m3>(a, stream) : launch<T, T>(a, stream);
  });
}

}  // namespace pagedkv::kernels
