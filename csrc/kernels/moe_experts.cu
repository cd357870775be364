// The mixture-of-experts decode kernels: GEMV-style, one warp per output row, reading only the
// rows of the experts each token chose. Simple on purpose: every (token, expert) pair reads its
// expert's rows itself (pairs of one expert share them through L2). The experts' format (dense,
// FP8) is the Rows argument (moe_expert_rows.cuh): it hands each kVec values over in the dtype.
#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/moe_expert_rows.cuh"
#include "kernels/moe_experts.h"
#include "kernels/silu.cuh"

namespace pagedkv::kernels {
namespace {

constexpr int kWarps = 8;  // output rows per block
constexpr int kThreads = kWarps * 32;

// (a . g[o], a . u[o]) for o < kOut over n elements (kVec-element vectors; g[o] a row of `gate`,
// u[o] of `up`), each summed per lane in order, then over the warp (every lane gets them all); one
// loop so that a lane's loads of every row (and of several of its vectors: unrolled) are in flight
// together. A row's sum is the same whatever kOut: only the rows beside it change.
template <typename T, int kVec, int kOut, typename Rows>
__device__ __forceinline__ void warp_dots(const T* __restrict__ a, const Rows& gate, const typename Rows::Row (&g)[kOut],
                                          const Rows& up, const typename Rows::Row (&u)[kOut], int64_t n,
                                          float (&gs)[kOut], float (&us)[kOut]) {
  using V = Vec<T, kVec>;
  const V* va = reinterpret_cast<const V*>(a);
#pragma unroll
  for (int o = 0; o < kOut; ++o) gs[o] = us[o] = 0.f;
#pragma unroll 4
  for (int64_t i = threadIdx.x % 32; i < n / kVec; i += 32) {
    const V x = va[i];
    V y1[kOut], y2[kOut];
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
      y1[o] = gate.template load<false>(g[o], i);
      y2[o] = up.template load<false>(u[o], i);
    }
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        gs[o] = fmaf(to_float(x.v[j]), to_float(y1[o].v[j]), gs[o]);
        us[o] = fmaf(to_float(x.v[j]), to_float(y2[o].v[j]), us[o]);
      }
    }
  }
#pragma unroll
  for (int o = 0; o < kOut; ++o) {
    gs[o] = warp_sum(gs[o]);
    us[o] = warp_sum(us[o]);
  }
}

// Whether the expert rows are stored dense (the model's dtype) rather than quantized: the launch
// shapes below differ by it.
template <typename Rows>
inline constexpr bool kDenseRows = false;
template <typename T, int kVec>
inline constexpr bool kDenseRows<DenseRows<T, kVec>> = true;

// Output rows a warp of the gate/up kernel computes: 2 for the quantized formats, whose warps read
// 4-8x fewer bytes a row than bf16 (at batch 1 on Qwen3-30B-A3B one row a warp is 768 blocks of
// short warps at 4-5 blocks an SM: two waves, latency-bound at ~17 us a layer whatever the format,
// session 38); 1 for dense rows, at ~89% of copy bandwidth as they are.
template <typename Rows>
inline constexpr int kGateUpRowsAWarp = kDenseRows<Rows> ? 1 : 2;

// grid: (T * k pairs, ceil(I / (kWarps kOut))); warp w of block (p, b) computes out[p, r] for the
// kOut rows r from (b * kWarps + w) * kOut.
// Expert e's gate row r is gate_up's row (e, r), its up row (e, up_first + r): one [E, 2I, D]
// stack (dense, up_first = I) or the gate and up of a quantized checkpoint ([E, I, D] each in
// one Rows whose rows run over both: up_first = 0 with `up` its own Rows).
template <typename T, int kVec, typename Rows, int kOut = kGateUpRowsAWarp<Rows>>
__global__ void __launch_bounds__(kThreads) moe_gate_up_silu_kernel(
    T* __restrict__ out,                 // [T, k, I]
    const T* __restrict__ x,             // [T, D]
    const Rows gate,                     // [E, ., D]
    const Rows up,                       // [E, ., D]
    int64_t up_first,
    const int64_t* __restrict__ ids,     // [T, k]
    int64_t top_k, int64_t num_experts, int64_t hidden, int64_t intermediate) {
  begin_dependent_kernel();
  const int64_t pair = blockIdx.x;
  const int64_t first = (static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32) * kOut;
  if (first >= intermediate) return;
  const int64_t e = ids[pair];
  float gs[kOut], us[kOut];
  const bool valid = e >= 0 && e < num_experts;
  if (valid) {
    typename Rows::Row g[kOut], u[kOut];
#pragma unroll
    for (int o = 0; o < kOut; ++o) {
      const int64_t r = min(first + o, intermediate - 1);  // past the end: row I - 1 again, not stored
      g[o] = gate.row(e, r);
      u[o] = up.row(e, up_first + r);
    }
    warp_dots<T, kVec, kOut, Rows>(x + (pair / top_k) * hidden, gate, g, up, u, hidden, gs, us);
  }
#pragma unroll
  for (int o = 0; o < kOut; ++o) {
    const T result = valid ? silu_mul(from_float<T>(gs[o]), from_float<T>(us[o])) : from_float<T>(0.f);
    if (threadIdx.x % 32 == 0 && first + o < intermediate) out[pair * intermediate + first + o] = result;
  }
}

// grid: (T, ceil(D / kWarps)); warp w of block (t, b) computes out[t, b * kWarps + w], summing
// the token's k experts in order.
// Experts of a token whose down rows a lane loads side by side: a warp's row of one expert is
// only intermediate / (32 kVec) loads a lane (3 at Qwen3-30B-A3B's 768), so one expert at a time
// left the loads of a batch-1 step too few in flight (the H100 profile: 35 us a layer for 25 MB).
constexpr int kDownGroup = 8;

// sum + HF's weighting of up to kDownGroup experts' per-lane dot products `part` (summed over
// the warp here): each expert's output rounded to the dtype, times its weight (weights[g]) in
// the weights' dtype, then an fp32 sum. No FMA. Every lane returns the same sum.
template <typename T, typename W, int kGroup>
__device__ __forceinline__ float add_weighted(float sum, const float (&part)[kGroup],
                                              const bool (&valid)[kGroup], const W* __restrict__ weights) {
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (!valid[g]) continue;
    const float y = to_float(from_float<T>(warp_sum(part[g])));
    sum = __fadd_rn(sum, to_float(from_float<W>(__fmul_rn(y, to_float(weights[g])))));
  }
  return sum;
}

// grid: (T, ceil(D / kWarps)); warp w of block (t, b) computes out[t, b * kWarps + w], summing
// the token's k experts in order. Each expert's dot product is summed in the same order as
// warp_dot2's (per lane over its vectors, then across the warp), kDownGroup experts at a time.
template <typename T, typename W, int kVec, typename Rows>
__global__ void __launch_bounds__(kThreads) moe_down_sum_kernel(
    T* __restrict__ out,                 // [T, D]
    const T* __restrict__ act,           // [T, k, I]
    const Rows down,                     // [E, D, I]
    const int64_t* __restrict__ ids,     // [T, k]
    const W* __restrict__ weights,       // [T, k]
    int64_t top_k, int64_t num_experts, int64_t hidden, int64_t intermediate) {
  using V = Vec<T, kVec>;
  begin_dependent_kernel();
  const int64_t t = blockIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  if (row >= hidden) return;
  const int64_t vecs = intermediate / kVec;
  float sum = 0.f;
  for (int64_t j0 = 0; j0 < top_k; j0 += kDownGroup) {
    const V* a_row[kDownGroup];                // act of pair (t, j0 + g)
    typename Rows::Row d_row[kDownGroup];  // row `row` of its expert's down
    bool valid[kDownGroup];      // the same in every lane (one token's ids): shuffles below are safe
    float part[kDownGroup];
#pragma unroll
    for (int g = 0; g < kDownGroup; ++g) {
      const int64_t j = j0 + g;
      const int64_t e = j < top_k ? ids[t * top_k + j] : -1;
      valid[g] = e >= 0 && e < num_experts;
      a_row[g] = reinterpret_cast<const V*>(act + (t * top_k + (valid[g] ? j : 0)) * intermediate);
      d_row[g] = down.row(valid[g] ? e : 0, row);
      part[g] = 0.f;
    }
    for (int64_t i = threadIdx.x % 32; i < vecs; i += 32) {
      V a[kDownGroup], d[kDownGroup];
#pragma unroll
      for (int g = 0; g < kDownGroup; ++g) {
        if (valid[g]) {
          a[g] = a_row[g][i];
          d[g] = down.template load<false>(d_row[g], i);
        }
      }
#pragma unroll
      for (int g = 0; g < kDownGroup; ++g) {
        if (valid[g]) {
#pragma unroll
          for (int v = 0; v < kVec; ++v) part[g] = fmaf(to_float(a[g].v[v]), to_float(d[g].v[v]), part[g]);
        }
      }
    }
    sum = add_weighted<T, W, kDownGroup>(sum, part, valid, weights + t * top_k + j0);
  }
  if (threadIdx.x % 32 == 0) out[t * hidden + row] = from_float<T>(sum);
}

// moe_down_sum_kernel for batch-1-sized grids (session 29: batch 1 3.99 -> 3.90 and 4.06 -> 4.01 ms
// on the Qwen3-30B-A3B shape in two A/B rounds on one H100, lab/measurements.md): the default
// kernel takes 215 registers in bf16 (the 8 experts' act and weight vectors, unpacked to fp32, all
// live at once), so one 256-thread block fits an SM and Qwen3-30B-A3B's 256 blocks run as two
// waves of 8 warps an SM. Here the token's k act rows are staged in shared memory once per block
// (each of the 8 warps read all of them from L1/L2 before) and read one expert at a time as its
// products are taken, the weights come through streaming loads after an L2 prefetch issued
// before the staging, and __launch_bounds__(.., kBlocks = 2) holds it under 128 registers (118 on
// sm_90, no spills): one wave of 16 warps an SM (kGroup = kDownGroup experts side by side; larger
// grids take kStagedDownBlocks, below). The same products in the same order: bit for bit the
// default kernel's results. 16-byte act vectors only; shared memory: k * I * sizeof(T) bytes.
template <typename T, typename W, int kVec, typename Rows, int kGroup, int kBlocks>
__global__ void __launch_bounds__(kThreads, kBlocks) moe_down_sum_staged_kernel(
    T* __restrict__ out,                 // [T, D]
    const T* __restrict__ act,           // [T, k, I]
    const Rows down,                     // [E, D, I]
    const int64_t* __restrict__ ids,     // [T, k]
    const W* __restrict__ weights,       // [T, k]
    int64_t top_k, int64_t num_experts, int64_t hidden, int64_t intermediate) {
  using V = Vec<T, kVec>;
  extern __shared__ __align__(16) unsigned char staged_raw[];
  V* staged = reinterpret_cast<V*>(staged_raw);  // [k, I / kVec]: act[t]
  begin_dependent_kernel();
  const int64_t t = blockIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  const int vecs = static_cast<int>(intermediate / kVec);
  // The warp's k weight rows asked of L2 first (one 128-byte line a lane), so DRAM streams them
  // while the block stages act; the loads below then find them in L2.
  const int lines = static_cast<int>((Rows::row_bytes(intermediate) + 127) / 128);
  for (int64_t j = 0; row < hidden && j < top_k; ++j) {
    const int64_t e = ids[t * top_k + j];
    if (e < 0 || e >= num_experts) continue;
    const char* d = reinterpret_cast<const char*>(down.row(e, row).values);
    for (int c = threadIdx.x % 32; c < lines; c += 32) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(d + c * 128));
    }
  }
  const V* act_t = reinterpret_cast<const V*>(act + t * top_k * intermediate);
  for (int i = threadIdx.x; i < top_k * vecs; i += kThreads) staged[i] = act_t[i];
  __syncthreads();
  if (row >= hidden) return;
  float sum = 0.f;
  for (int64_t j0 = 0; j0 < top_k; j0 += kGroup) {
    typename Rows::Row d_row[kGroup];  // row `row` of pair (t, j0 + g)'s expert's down
    bool valid[kGroup];  // the same in every lane (one token's ids): shuffles below are safe
    float part[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int64_t j = j0 + g;
      const int64_t e = j < top_k ? ids[t * top_k + j] : -1;
      valid[g] = e >= 0 && e < num_experts;
      d_row[g] = down.row(valid[g] ? e : 0, row);
      part[g] = 0.f;
    }
    const V* a_base = staged + j0 * vecs;  // act of pair (t, j0 + g) at a_base + g * vecs
    for (int i = threadIdx.x % 32; i < vecs; i += 32) {
      V d[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (valid[g]) d[g] = down.template load<true>(d_row[g], i);
      }
      // act from shared memory one expert at a time, as its products are taken: only the
      // weights' registers stay live across the loads' latency.
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (valid[g]) {
          const V a = a_base[g * vecs + i];
#pragma unroll
          for (int v = 0; v < kVec; ++v) part[g] = fmaf(to_float(a.v[v]), to_float(d[g].v[v]), part[g]);
        }
      }
    }
    sum = add_weighted<T, W, kGroup>(sum, part, valid, weights + t * top_k + j0);
  }
  if (threadIdx.x % 32 == 0) out[t * hidden + row] = from_float<T>(sum);
}

// Blocks an SM of the staged kernel reading 4 experts side by side instead of 8, for grids past
// one wave (2 or more tokens: Qwen3-30B-A3B at batch 8 is 2048 blocks, ~8 waves at 2 an SM; the
// H200 profile of session 39 had the int4 down at 106 us a layer there against bf16's 73): with
// half the experts' registers, 3 blocks of quantized rows (68-76 registers on sm_90) or 4 of dense
// ones (64) fit an SM without spills. Each expert's products and their sum keep their order, so
// the results are the 8-expert kernel's, bit for bit.
template <typename Rows>
inline constexpr int kStagedDownBlocks = kDenseRows<Rows> ? 4 : 3;

// The staged kernel's shared memory stays within the default 48 KB (no opt-in attribute): k * I
// bf16 of Qwen3-30B-A3B (8 x 768) is 12 KB, Mixtral's (2 x 14336) 56 KB takes the default kernel.
constexpr size_t kStagedMaxBytes = 48 * 1024;

unsigned blocks_for(int64_t rows) { return static_cast<unsigned>((rows + kWarps - 1) / kWarps); }

template <typename T, int kVec, typename Rows>
cudaError_t launch_gate_up_silu(void* out, const void* x, const Rows& gate, const Rows& up, int64_t up_first,
                                const int64_t* expert_ids, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                int64_t hidden, int64_t intermediate, cudaStream_t stream) {
  constexpr int kOut = kGateUpRowsAWarp<Rows>;
  const dim3 grid(static_cast<unsigned>(num_tokens * top_k), blocks_for((intermediate + kOut - 1) / kOut));
  return launch_dependent(moe_gate_up_silu_kernel<T, kVec, Rows>, grid, kThreads, 0, stream, static_cast<T*>(out),
                          static_cast<const T*>(x), gate, up, up_first, expert_ids, top_k, num_experts, hidden,
                          intermediate);
}

// The staged kernel where its act vectors and shared memory allow, else the default one.
template <typename T, int kVec, typename Rows>
cudaError_t launch_down_sum(void* out, const void* act, const Rows& down, const int64_t* expert_ids,
                            const void* weights, bool weights_fp32, int64_t num_tokens, int64_t top_k,
                            int64_t num_experts, int64_t hidden, int64_t intermediate, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_tokens), blocks_for(hidden));
  auto* o = static_cast<T*>(out);
  auto* a = static_cast<const T*>(act);
  auto run = [&](auto weight_tag) {
    using W = decltype(weight_tag);
    auto* w = static_cast<const W*>(weights);
    if constexpr (kVec == 16 / sizeof(T)) {
      const size_t staged_bytes = static_cast<size_t>(top_k * intermediate) * sizeof(T);
      if (staged_bytes <= kStagedMaxBytes && num_tokens > 1) {  // past one wave: more blocks an SM
        return launch_dependent(moe_down_sum_staged_kernel<T, W, kVec, Rows, 4, kStagedDownBlocks<Rows>>,
                                grid, kThreads, staged_bytes, stream, o, a, down, expert_ids, w, top_k,
                                num_experts, hidden, intermediate);
      }
      if (staged_bytes <= kStagedMaxBytes) {
        return launch_dependent(moe_down_sum_staged_kernel<T, W, kVec, Rows, kDownGroup, 2>, grid, kThreads,
                                staged_bytes, stream, o, a, down, expert_ids, w, top_k, num_experts, hidden,
                                intermediate);
      }
    }
    return launch_dependent(moe_down_sum_kernel<T, W, kVec, Rows>, grid, kThreads, 0, stream, o, a, down,
                            expert_ids, w, top_k, num_experts, hidden, intermediate);
  };
  return weights_fp32 ? run(float{}) : run(T{});
}

}  // namespace

cudaError_t moe_gate_up_silu(void* out, const void* x, const void* gate_up, const int64_t* expert_ids,
                             int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                             int64_t intermediate, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0 || intermediate == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto* w = static_cast<const T*>(gate_up);
    if (hidden % kVec == 0 && aligned16(x) && aligned16(gate_up)) {
      const DenseRows<T, kVec> rows{w, 2 * intermediate, hidden};
      launch_gate_up_silu<T, kVec>(out, x, rows, rows, intermediate, expert_ids, num_tokens, top_k, num_experts,
                                   hidden, intermediate, stream);
    } else {
      const DenseRows<T, 1> rows{w, 2 * intermediate, hidden};
      launch_gate_up_silu<T, 1>(out, x, rows, rows, intermediate, expert_ids, num_tokens, top_k, num_experts,
                                hidden, intermediate, stream);
    }
    return cudaGetLastError();
  });
}

cudaError_t moe_down_sum(void* out, const void* act, const void* down, const int64_t* expert_ids,
                         const void* weights, bool weights_fp32, int64_t num_tokens, int64_t top_k,
                         int64_t num_experts, int64_t hidden, int64_t intermediate, DType dtype,
                         cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    auto* d = static_cast<const T*>(down);
    if (intermediate % kVec == 0 && aligned16(act) && aligned16(down)) {
      launch_down_sum<T, kVec>(out, act, DenseRows<T, kVec>{d, hidden, intermediate}, expert_ids, weights,
                               weights_fp32, num_tokens, top_k, num_experts, hidden, intermediate, stream);
    } else {
      launch_down_sum<T, 1>(out, act, DenseRows<T, 1>{d, hidden, intermediate}, expert_ids, weights, weights_fp32,
                            num_tokens, top_k, num_experts, hidden, intermediate, stream);
    }
    return cudaGetLastError();
  });
}

cudaError_t moe_gate_up_silu_fp8(void* out, const void* x, const uint8_t* gate, const float* gate_scales,
                                 const uint8_t* up, const float* up_scales, const int64_t* expert_ids,
                                 int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                                 int64_t intermediate, int block_n, int block_k, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0 || intermediate == 0) return cudaSuccess;
  if (hidden % kMoeQuantAlign != 0 || block_k % kMoeQuantAlign != 0 || !aligned16(x) || !aligned16(gate) ||
      !aligned16(up)) {
    return cudaErrorInvalidValue;
  }
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const FastDivisor loads_a_block(static_cast<uint32_t>(block_k / kVec));
    const Fp8Rows<T, kVec> gate_rows{gate, gate_scales, intermediate, hidden, block_n, block_k, loads_a_block};
    const Fp8Rows<T, kVec> up_rows{up, up_scales, intermediate, hidden, block_n, block_k, loads_a_block};
    launch_gate_up_silu<T, kVec>(out, x, gate_rows, up_rows, 0, expert_ids, num_tokens, top_k, num_experts, hidden,
                                 intermediate, stream);
    return cudaGetLastError();
  });
}

cudaError_t moe_down_sum_fp8(void* out, const void* act, const uint8_t* down, const float* down_scales,
                             const int64_t* expert_ids, const void* weights, bool weights_fp32, int64_t num_tokens,
                             int64_t top_k, int64_t num_experts, int64_t hidden, int64_t intermediate, int block_n,
                             int block_k, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  if (intermediate % kMoeQuantAlign != 0 || block_k % kMoeQuantAlign != 0 || !aligned16(act) || !aligned16(down)) {
    return cudaErrorInvalidValue;
  }
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const FastDivisor loads_a_block(static_cast<uint32_t>(block_k / kVec));
    const Fp8Rows<T, kVec> rows{down, down_scales, hidden, intermediate, block_n, block_k, loads_a_block};
    launch_down_sum<T, kVec>(out, act, rows,
                             expert_ids, weights, weights_fp32, num_tokens, top_k, num_experts, hidden, intermediate,
                             stream);
    return cudaGetLastError();
  });
}

cudaError_t moe_gate_up_silu_int4(void* out, const void* x, const Int4ExpertsArgs& gate, const Int4ExpertsArgs& up,
                                  const int64_t* expert_ids, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                  int64_t hidden, int64_t intermediate, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0 || intermediate == 0) return cudaSuccess;
  for (const Int4ExpertsArgs* p : {&gate, &up}) {
    if (hidden % kMoeQuantAlign != 0 || p->group_size % kMoeQuantAlign != 0 || hidden % p->group_size != 0 ||
        !aligned16(p->packed)) {
      return cudaErrorInvalidValue;
    }
  }
  if (!aligned16(x) || gate.scale_dtype != up.scale_dtype) return cudaErrorInvalidValue;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    return dispatch_dtype(gate.scale_dtype, [&](auto scale_tag) {
      using S = decltype(scale_tag);
      auto rows = [&](const Int4ExpertsArgs& p) {
        return Int4Rows<T, kVec, S>{p.packed, static_cast<const S*>(p.scales), p.zeros, intermediate, hidden,
                                    p.group_size, FastDivisor(static_cast<uint32_t>(p.group_size / kVec))};
      };
      launch_gate_up_silu<T, kVec>(out, x, rows(gate), rows(up), 0, expert_ids, num_tokens, top_k, num_experts,
                                   hidden, intermediate, stream);
      return cudaGetLastError();
    });
  });
}

cudaError_t moe_down_sum_int4(void* out, const void* act, const Int4ExpertsArgs& down, const int64_t* expert_ids,
                              const void* weights, bool weights_fp32, int64_t num_tokens, int64_t top_k,
                              int64_t num_experts, int64_t hidden, int64_t intermediate, DType dtype,
                              cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  if (intermediate % kMoeQuantAlign != 0 || down.group_size % kMoeQuantAlign != 0 ||
      intermediate % down.group_size != 0 || !aligned16(act) || !aligned16(down.packed)) {
    return cudaErrorInvalidValue;
  }
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    return dispatch_dtype(down.scale_dtype, [&](auto scale_tag) {
      using S = decltype(scale_tag);
      const Int4Rows<T, kVec, S> rows{down.packed, static_cast<const S*>(down.scales), down.zeros, hidden,
                                      intermediate, down.group_size,
                                      FastDivisor(static_cast<uint32_t>(down.group_size / kVec))};
      launch_down_sum<T, kVec>(out, act, rows, expert_ids, weights, weights_fp32, num_tokens, top_k, num_experts,
                               hidden, intermediate, stream);
      return cudaGetLastError();
    });
  });
}

}  // namespace pagedkv::kernels
