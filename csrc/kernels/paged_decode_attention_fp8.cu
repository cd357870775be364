// Paged attention over an fp8 (e4m3) KV cache (decode and prefill): one warp per (query row,
// query head) walks the row's visible keys in order with an online softmax (fp32 scores and max;
// the sum and the weighted V sum in fp64, rescaled at each new max, as the CPU twin sums them: one
// sequential chain over up to 64k keys; fp64 is half-rate on Hopper and this loop waits on its
// loads), each K/V element dequantized in registers as float(x) * scale. The softcap is the
// 16-bit kernels' precise one (--use_fast_math makes tanhf tanh.approx: ~2^-11 relative, which
// failed the fp32 tests on an H100, session 25).
// Lane l owns dims l, l + 32, ... of the head (byte loads, coalesced over the warp); a key's score
// is the warp's shuffle sum. Simple on purpose: the 16-bit paths' tensor-core loops read K/V with
// ldmatrix and are left as they are; speed for fp8 comes later.
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/paged_decode_attention_common.cuh"
#include "kernels/paged_decode_attention_fp8.h"

namespace pagedkv::kernels {
namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kMaxPerLane = 8;  // head_dim <= 256 = 8 * 32

__device__ __forceinline__ float fp8_value(const __nv_fp8_e4m3& x) { return static_cast<float>(x); }

template <typename T>
__global__ void __launch_bounds__(kWarpsPerCta * 32) paged_fp8_kernel(const PagedFp8Args a) {
  begin_dependent_kernel();
  const int lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  if (item >= static_cast<int64_t>(a.num_rows) * a.num_q_heads) return;  // uniform per warp
  const int row = static_cast<int>(item / a.num_q_heads);
  const int h = static_cast<int>(item % a.num_q_heads);
  const int max_tokens = a.max_blocks * a.block_size;
  int b = row, ctx = 0, pos = 0;
  if (a.query_start_loc == nullptr) {
    if (row >= a.batch) return;
    ctx = min(max(a.context_lens[b], 0), max_tokens);
    pos = ctx - 1;
  } else {
    const int* qsl = a.query_start_loc;
    if (a.batch == 0 || row < qsl[0] || row >= qsl[a.batch]) return;  // outside every sequence
    int lo = 0, hi = a.batch;  // the last b with qsl[b] <= row: then row < qsl[b + 1]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (qsl[mid] <= row) lo = mid;
      else hi = mid;
    }
    b = lo;
    ctx = min(max(a.context_lens[b], 0), max_tokens);
    pos = ctx - (qsl[b + 1] - qsl[b]) + (row - qsl[b]);
  }
  const int D = a.head_dim;
  T* out = static_cast<T*>(a.out) + row * a.out_stride_row + h * a.out_stride_h;
  const T* q = static_cast<const T*>(a.q) + row * a.q_stride_row + h * a.q_stride_h;
  const int kv_head = h / (a.num_q_heads / a.num_kv_heads);
  const int first = a.sliding_window > 0 ? max(0, pos - a.sliding_window + 1) : 0;

  float qv[kMaxPerLane];
  double acc[kMaxPerLane];
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int d = lane + 32 * j;
    qv[j] = d < D ? to_float(q[d]) * a.scale : 0.f;
    acc[j] = 0.0;
  }
  const float k_scale = *a.k_scale, v_scale = *a.v_scale;
  const auto* k_base = static_cast<const __nv_fp8_e4m3*>(a.k_cache);
  const auto* v_base = static_cast<const __nv_fp8_e4m3*>(a.v_cache);
  const int* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks;
  float max_score = -INFINITY;
  double sum = 0.0;
  for (int t = first; t <= pos; ++t) {  // pos < ctx <= max_tokens; none when pos < 0
    const int64_t offset = table[t / a.block_size] * a.cache_stride_block +
                           (t % a.block_size) * a.cache_stride_token + kv_head * a.cache_stride_head;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < D) dot += qv[j] * (fp8_value(k_base[offset + d]) * k_scale);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (a.logit_softcap > 0.f) dot = decode::softcap_log2<T>(dot, a.logit_softcap);  // any units
    const float new_max = fmaxf(max_score, dot);
    const float rescale = expf(max_score - new_max);  // 0 at the first key
    const float p = expf(dot - new_max);
    sum = fma(sum, static_cast<double>(rescale), static_cast<double>(p));
#pragma unroll
    for (int j = 0; j < kMaxPerLane; ++j) {
      const int d = lane + 32 * j;
      if (d < D) {
        const double pv = static_cast<double>(p) * (fp8_value(v_base[offset + d]) * v_scale);
        acc[j] = fma(acc[j], static_cast<double>(rescale), pv);
      }
    }
    max_score = new_max;
  }
  double inv = sum > 0.0 ? 1.0 / sum : 0.0;  // no key: zeros (a padding row)
  if (a.sinks != nullptr && sum > 0.0) {  // natural units here: the joint max of scores and sink
    const float sink = a.sinks[h];
    const float joint = fmaxf(max_score, sink);
    const double rescale = exp(static_cast<double>(max_score - joint));
    inv = rescale / fma(sum, rescale, exp(static_cast<double>(sink - joint)));
  }
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int d = lane + 32 * j;
    if (d < D) out[d] = from_float<T>(static_cast<float>(acc[j] * inv));
  }
}

}  // namespace

cudaError_t paged_attention_fp8(const PagedFp8Args& a, DType dtype, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(a.num_rows) * a.num_q_heads;
  if (items == 0) return cudaSuccess;
  if (a.head_dim > 32 * kMaxPerLane || a.num_kv_heads < 1 || a.num_q_heads % a.num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t ctas = (items + kWarpsPerCta - 1) / kWarpsPerCta;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_dependent(paged_fp8_kernel<T>, static_cast<unsigned>(ctas), kWarpsPerCta * 32, 0,
                     stream, a);
    return cudaGetLastError();
  });
}

}  // namespace pagedkv::kernels
