// One thread block per logits row; every pass reads the row in index order (16-byte loads when
// aligned). Greedy rows take one pass: argmax as a max over (order key, ~index), which is
// torch.argmax exactly (NaN largest, lowest index on ties). A sampled row whose max is NaN or
// inf (or -inf: all -inf) gets -1, an invalid token the host raises on. Sampled rows, with weights
// w = floor(2^40 * exp((logit - max) / T)) (sample_math.h):
//   top-k threshold: radix select (11/11/10-bit digits of the order key, shared-memory
//     histograms) of the k-th largest key: keeps every token tied with the k-th, as HF does;
//   top-p threshold: the same select weighted by w over the top-k tokens: the largest key whose
//     weight at or above it reaches top_p of their total (HF's nucleus: smallest top set whose
//     probability reaches top_p, ties kept);
//   draw: target = floor(u * total kept weight) from the counter-based uniform of (seed, offset);
//     the token is the first whose running weight in index order exceeds it (block scans).
// Integer weights make every sum exact and order-free, so a row's token is deterministic.
//
// Rows longer than kSampleChunk are first read by many blocks (chunk_max_kernel, then
// chunk_weight_kernel: [batch, chunks] argmax keys and weight totals), since one block per row
// reads at one SM's bandwidth: a 256-row step of a 152k vocabulary took 150 us on an H100 with
// a block per row. The row's block then takes its max from the chunk keys and, for a row with no
// top-k/top-p, the chunk holding the target from the chunk totals, and scans only that chunk:
// the same max, total, target and first index as one block reading the whole row.
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dependent_launch.cuh"
#include "kernels/sample.h"
#include "kernels/sample_math.h"

namespace pagedkv::kernels {
namespace {

using sampling::drawable;
using sampling::order_key;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2048;
static_assert(kWarps == 32 && kBins == 2 * kThreads, "the block scans below assume these sizes");

__device__ __forceinline__ uint64_t warp_inclusive_scan(uint64_t x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const uint64_t y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
}

// Exclusive prefix sum in thread order; `total` gets the block's sum. All threads must call it.
__device__ uint64_t block_exclusive_scan(uint64_t x, uint64_t& total) {
  __shared__ uint64_t warp_sums[kWarps];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const uint64_t inclusive = warp_inclusive_scan(x);
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_scan(warp_sums[lane]);
  __syncthreads();
  total = warp_sums[kWarps - 1];
  const uint64_t result = (warp == 0 ? 0 : warp_sums[warp - 1]) + inclusive - x;
  __syncthreads();  // warp_sums is reused by the next call
  return result;
}

__device__ uint64_t block_max(uint64_t x) {
  __shared__ uint64_t warp_max[kWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint64_t y = __shfl_xor_sync(0xffffffffu, x, offset);
    x = y > x ? y : x;
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = x;
  __syncthreads();
  x = warp_max[threadIdx.x % 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint64_t y = __shfl_xor_sync(0xffffffffu, x, offset);
    x = y > x ? y : x;
  }
  __syncthreads();
  return x;
}

// One logits row, visited in index order: thread t takes elements [t * kVec, (t + 1) * kVec) of
// each tile of kThreads * kVec, then the < kVec leftover elements one per thread.
template <typename T, int kVec>
struct Row {
  const T* logits;
  int vocab;

  __device__ int num_vecs() const { return vocab / kVec; }
  __device__ Vec<T, kVec> vec(int v) const { return reinterpret_cast<const Vec<T, kVec>*>(logits)[v]; }

  // f(value, index) for every element, in no particular order (every use is order-free: a max,
  // histogram counts, integer sums). One SM reads the whole row, so each thread keeps kAhead
  // loads in flight: with one, a 152k-entry row took ~17 us on an H100, latency-bound.
  template <typename F>
  __device__ void for_each_indexed(F&& f) const {
    constexpr int kAhead = 4;
    const int n = num_vecs();
    int v = threadIdx.x;
    for (; v + (kAhead - 1) * kThreads < n; v += kAhead * kThreads) {
      Vec<T, kVec> x[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) x[u] = vec(v + u * kThreads);
#pragma unroll
      for (int u = 0; u < kAhead; ++u)
#pragma unroll
        for (int j = 0; j < kVec; ++j) f(to_float(x[u].v[j]), (v + u * kThreads) * kVec + j);
    }
    for (; v < n; v += kThreads) {
      const Vec<T, kVec> x = vec(v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(to_float(x.v[j]), v * kVec + j);
    }
    for (int i = n * kVec + threadIdx.x; i < vocab; i += kThreads) f(to_float(logits[i]), i);
  }

  template <typename F>
  __device__ void for_each(F&& f) const {
    for_each_indexed([&](float x, int) { f(x); });
  }
};

// The largest key t >= lower such that the weight of the tokens with key >= t reaches target,
// or lower if none does. With relative, target is top_p, turned into top_p_target(top_p, weight
// of all keys >= lower) once the first histogram has that weight.
template <typename RowT, typename Weight>
__device__ uint32_t radix_select(const RowT& row, uint64_t* hist, uint32_t lower, Weight weight,
                                 double target, bool relative) {
  __shared__ int chosen_bin;
  __shared__ uint64_t chosen_above;
  uint32_t prefix = 0;
  uint32_t prefix_mask = 0;
  uint64_t above = 0;  // weight of the keys above the current prefix's range
  for (int level = 0; level < 3; ++level) {
    const int shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
    const uint32_t digit_mask = level == 2 ? 0x3ffu : 0x7ffu;
    for (int b = threadIdx.x; b < kBins; b += kThreads) hist[b] = 0;
    if (threadIdx.x == 0) chosen_bin = -1;
    __syncthreads();
    row.for_each([&](float x) {
      const uint32_t key = order_key(x);
      if (key >= lower && (key & prefix_mask) == prefix) {
        const uint64_t w = weight(x);
        if (w != 0) {
          atomicAdd(reinterpret_cast<unsigned long long*>(&hist[(key >> shift) & digit_mask]),
                    static_cast<unsigned long long>(w));
        }
      }
    });
    __syncthreads();
    // Thread t holds bins kBins-1-2t (hi) and kBins-2-2t: a scan in thread order runs from the
    // highest bin down; the bin where the running weight first reaches target holds t.
    const int hi = kBins - 1 - 2 * static_cast<int>(threadIdx.x);
    const uint64_t w_hi = hist[hi];
    const uint64_t w_lo = hist[hi - 1];
    uint64_t total;
    const uint64_t before = above + block_exclusive_scan(w_hi + w_lo, total);
    if (level == 0 && relative) target = sampling::top_p_target(static_cast<float>(target), total);
    if (static_cast<double>(before) < target && static_cast<double>(before + w_hi + w_lo) >= target) {
      const bool in_hi = static_cast<double>(before + w_hi) >= target;
      chosen_bin = in_hi ? hi : hi - 1;
      chosen_above = in_hi ? before : before + w_hi;
    }
    __syncthreads();
    const int bin = chosen_bin;
    above = chosen_above;
    __syncthreads();  // chosen_* and hist are rewritten by the next level (or the next select)
    if (bin < 0) return lower;  // uniform: all the weight is below target
    prefix |= static_cast<uint32_t>(bin) << shift;
    prefix_mask |= digit_mask << shift;
  }
  return prefix;
}

// The first token, in index order, whose running kept weight exceeds target; -1 if none.
template <typename T, int kVec, typename Weight>
__device__ int inverse_cdf(const Row<T, kVec>& row, Weight kept_weight, uint64_t target) {
  __shared__ int found;
  if (threadIdx.x == 0) found = -1;  // the scans' barriers order this before any write below
  uint64_t running = 0;
  const auto tile = [&](bool has, int first, auto&& weight_of) {
    uint64_t local = 0;
    if (has) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) local += weight_of(j);
    }
    uint64_t tile_total;
    const uint64_t before = running + block_exclusive_scan(local, tile_total);
    if (before <= target && target < before + local) {
      uint64_t c = before;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        c += weight_of(j);
        if (c > target) {
          found = first + j;
          break;
        }
      }
    }
    running += tile_total;
    __syncthreads();
  };
  for (int base = 0; base < row.num_vecs(); base += kThreads) {
    const int v = base + threadIdx.x;
    Vec<T, kVec> x{};
    if (v < row.num_vecs()) x = row.vec(v);
    tile(v < row.num_vecs(), v * kVec, [&](int j) { return kept_weight(to_float(x.v[j])); });
    if (found >= 0) return found;
  }
  const int i = row.num_vecs() * kVec + threadIdx.x;  // leftover elements, one per thread
  if (row.num_vecs() * kVec < row.vocab) {
    const bool has = i < row.vocab;
    const float x = has ? to_float(row.logits[i]) : 0.f;
    tile(has, i, [&](int j) { return j == 0 ? kept_weight(x) : uint64_t{0}; });
  }
  return found;
}

// (order key, ~index): its max over a row is torch.argmax's answer (NaN largest, lowest index).
__device__ __forceinline__ uint64_t packed_key(float x, int i) {
  return (static_cast<uint64_t>(order_key(x)) << 32) | static_cast<uint32_t>(~i);
}

// A row's token weight given its max logit (sample_math.h's fixed point, in CUDA's arithmetic).
struct TokenWeight {
  float max_logit, temperature;
  __device__ uint64_t operator()(float x) const {
    const float s = x == max_logit ? 0.f : __fdiv_rn(__fsub_rn(x, max_logit), temperature);
    return __float2ull_rz(__expf(s) * sampling::kWeightScale);
  }
};

__device__ __forceinline__ bool unfiltered(const SampleArgs& a, int r) {
  const int top_k = a.top_k != nullptr ? a.top_k[r] : 0;
  const float top_p = a.top_p != nullptr ? a.top_p[r] : 1.f;
  return !(top_k > 0 && top_k < a.vocab) && !(top_p < 1.f);
}

// The max of the chunk keys of row r (every thread gets it).
__device__ __forceinline__ uint64_t row_best(const SampleArgs& a, int r, int chunks) {
  uint64_t best = 0;
  for (int c = 0; c < chunks; ++c) {
    const uint64_t b = a.chunk_best[static_cast<int64_t>(r) * chunks + c];
    best = b > best ? b : best;
  }
  return best;
}

constexpr int kChunkThreads = 256;

template <typename F>
__device__ uint64_t chunk_reduce(uint64_t x, F&& op) {
  __shared__ uint64_t partial[kChunkThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kChunkThreads / 32; ++w) x = op(x, partial[w]);
  }
  return x;  // valid in thread 0
}

// f(value, index) over logits [begin, end) of one row; begin is a multiple of kSampleChunk.
template <typename T, int kVec, typename F>
__device__ void for_each_in_chunk(const T* logits, int begin, int end, F&& f) {
  const int n = (end - begin) / kVec;
  const auto* vecs = reinterpret_cast<const Vec<T, kVec>*>(logits + begin);
#pragma unroll 4
  for (int v = threadIdx.x; v < n; v += kChunkThreads) {
    const Vec<T, kVec> x = vecs[v];
#pragma unroll
    for (int j = 0; j < kVec; ++j) f(to_float(x.v[j]), begin + v * kVec + j);
  }
  for (int i = begin + n * kVec + threadIdx.x; i < end; i += kChunkThreads) f(to_float(logits[i]), i);
}

// grid (chunks, batch): chunk_best[r, c] = max packed key of chunk c of row r.
template <typename T, int kVec>
__global__ void __launch_bounds__(kChunkThreads) chunk_max_kernel(const SampleArgs a, int chunks) {
  begin_dependent_kernel();
  const int c = blockIdx.x, r = blockIdx.y;
  const T* logits = static_cast<const T*>(a.logits) + r * a.row_stride;
  const int begin = c * kSampleChunk;
  const int end = min(begin + kSampleChunk, a.vocab);
  uint64_t best = 0;
  for_each_in_chunk<T, kVec>(logits, begin, end, [&](float x, int i) {
    const uint64_t p = packed_key(x, i);
    best = p > best ? p : best;
  });
  best = chunk_reduce(best, [](uint64_t x, uint64_t y) { return x > y ? x : y; });
  if (threadIdx.x == 0) a.chunk_best[static_cast<int64_t>(r) * chunks + c] = best;
}

// grid (chunks, batch): chunk_weight[r, c] = total weight of chunk c of row r, for rows drawn
// from the chunk totals (sampled, no top-k/top-p); others get 0 (not read).
template <typename T, int kVec>
__global__ void __launch_bounds__(kChunkThreads) chunk_weight_kernel(const SampleArgs a, int chunks) {
  begin_dependent_kernel();
  const int c = blockIdx.x, r = blockIdx.y;
  const int64_t at = static_cast<int64_t>(r) * chunks + c;
  const float temperature = a.temperatures[r];
  const uint64_t best = row_best(a, r, chunks);
  if (!(temperature > 0.f) || !drawable(static_cast<uint32_t>(best >> 32)) || !unfiltered(a, r)) {
    if (threadIdx.x == 0) a.chunk_weight[at] = 0;
    return;
  }
  const T* logits = static_cast<const T*>(a.logits) + r * a.row_stride;
  const TokenWeight weight{to_float(logits[static_cast<int>(~static_cast<uint32_t>(best))]), temperature};
  const int begin = c * kSampleChunk;
  uint64_t total = 0;
  for_each_in_chunk<T, kVec>(logits, begin, min(begin + kSampleChunk, a.vocab),
                             [&](float x, int) { total += weight(x); });
  total = chunk_reduce(total, [](uint64_t x, uint64_t y) { return x + y; });
  if (threadIdx.x == 0) a.chunk_weight[at] = total;
}

// One block draws row r from the whole row (top-k/top-p thresholds, then the inverse CDF);
// token is left as is when nothing is drawn.
template <typename T, int kVec>
__device__ void sample_row(const SampleArgs& a, int r, const Row<T, kVec>& row, uint64_t* hist,
                           const TokenWeight& weight, int& token) {
  const int top_k = a.top_k != nullptr ? a.top_k[r] : 0;
  const float top_p = a.top_p != nullptr ? a.top_p[r] : 1.f;
  uint32_t threshold = 0;
  if (top_k > 0 && top_k < a.vocab) {
    threshold = radix_select(row, hist, 0, [](float) { return uint64_t{1}; }, top_k, false);
  }
  if (top_p < 1.f) threshold = radix_select(row, hist, threshold, weight, top_p, true);

  const auto kept_weight = [=](float x) -> uint64_t {
    return order_key(x) >= threshold ? weight(x) : 0;
  };
  uint64_t local = 0;
  row.for_each([&](float x) { local += kept_weight(x); });
  uint64_t total;
  block_exclusive_scan(local, total);
  if (total > 0) {
    const uint64_t target = sampling::draw_target(total, sampling::uniform(a.seeds[r], a.offsets[r]));
    const int drawn = inverse_cdf(row, kept_weight, target);
    if (drawn >= 0) token = drawn;
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads, 1) sample_kernel(const SampleArgs a, int chunks) {
  begin_dependent_kernel();
  __shared__ uint64_t hist[kBins];
  const int r = blockIdx.x;
  const Row<T, kVec> row{static_cast<const T*>(a.logits) + r * a.row_stride, a.vocab};

  // Greedy: the max over (order key, ~index) is torch.argmax's answer.
  uint64_t best = 0;
  if (chunks > 0) {
    best = row_best(a, r, chunks);
  } else {
    row.for_each_indexed([&](float x, int i) {
      const uint64_t p = packed_key(x, i);
      best = p > best ? p : best;
    });
    best = block_max(best);
  }
  int token = static_cast<int>(~static_cast<uint32_t>(best));
  const uint32_t max_key = static_cast<uint32_t>(best >> 32);
  const float temperature = a.temperatures != nullptr ? a.temperatures[r] : 0.f;

  // Sample when T > 0: from a row whose max is finite, else the invalid token (the max key,
  // read anyway for the argmax, already says whether the row holds a NaN or inf).
  if (temperature > 0.f && !drawable(max_key)) {
    token = static_cast<int>(sampling::kInvalidToken);
  } else if (temperature > 0.f) {
    const TokenWeight weight{to_float(row.logits[token]), temperature};
    if (chunks > 0 && unfiltered(a, r)) {
      // The chunk where the running total first exceeds the target, and the target within it.
      const uint64_t* totals = a.chunk_weight + static_cast<int64_t>(r) * chunks;
      uint64_t total = 0;
      for (int c = 0; c < chunks; ++c) total += totals[c];
      uint64_t target = sampling::draw_target(total, sampling::uniform(a.seeds[r], a.offsets[r]));
      int c = 0;
      while (c + 1 < chunks && target >= totals[c]) target -= totals[c++];
      const int begin = c * kSampleChunk;
      const Row<T, kVec> chunk{row.logits + begin, min(kSampleChunk, a.vocab - begin)};
      const int drawn = inverse_cdf(chunk, weight, target);
      if (drawn >= 0) token = begin + drawn;
    } else {
      sample_row(a, r, row, hist, weight, token);
    }
  }
  if (threadIdx.x == 0) {
    if (a.out_is_int64) static_cast<int64_t*>(a.out)[r] = token;
    else static_cast<int32_t*>(a.out)[r] = token;
  }
}

}  // namespace

cudaError_t sample(const SampleArgs& a, DType dtype, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = aligned16(a.logits) && (a.row_stride * sizeof(T)) % 16 == 0;
    const auto launch = [&](auto vec) {
      constexpr int kV = decltype(vec)::value;
      const int chunks = a.chunk_best != nullptr ? sample_chunks(a.batch, a.vocab) : 0;
      if (chunks > 0) {
        const dim3 grid(chunks, a.batch);
        launch_dependent(chunk_max_kernel<T, kV>, grid, kChunkThreads, 0, stream, a, chunks);
        if (a.temperatures != nullptr) launch_dependent(chunk_weight_kernel<T, kV>, grid, kChunkThreads, 0, stream, a, chunks);
      }
      launch_dependent(sample_kernel<T, kV>, a.batch, kThreads, 0, stream, a, chunks);
    };
    if (vectorized) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    return cudaGetLastError();
  });
}

}  // namespace pagedkv::kernels
