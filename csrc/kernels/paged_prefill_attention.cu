// Paged prefill attention on CUDA cores, fp32 math. One thread block (CTA) per (sequence, kv head,
// head chunk, tile of query tokens): its kRows rows are (token, query head) pairs of the kv
// head's group, so every K/V tile read into shared memory serves the whole group (GQA). The CTA
// walks the context's keys in tiles of kKeys up to its last token's position:
//   S = Q K^T (2 rows x 4 keys a thread), causal mask, online softmax in log2 units, P to shared
//   memory, O += P V (2 rows x D/8 columns a thread, fp32 registers).
// K/V rows are fetched with cp.async straight from their cache blocks (zero-filled past the last
// key), as flash-attention 2 orders it: V of tile j loads while S of tile j is computed, K of
// tile j + 1 while O is updated, so one K and one V buffer suffice. Tiles are ordered latest
// first (they have the most keys), so the long CTAs start in the first wave.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/common.cuh"
#include "kernels/paged_prefill_attention.h"

namespace pagedkv::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 64;            // (token, head) rows of a CTA
constexpr int kKeys = 32;            // keys per K/V tile
constexpr int kMaxChunkHeads = 16;   // larger groups are cut into chunks: >= 4 tokens a tile
constexpr int kPLd = kKeys + 8;      // P row stride (floats): 4 rows of 8 lanes hit 32 banks
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegBig = -1e30f;    // "no key yet": finite, so exp2f(kNegBig - x) is 0, not NaN

// Shared-memory row stride of Q/K/V tiles in elements: 16 bytes of padding shift consecutive rows
// by 4 banks (8 rows read side by side hit distinct banks) and keep rows 16-byte aligned.
template <typename T, int D>
constexpr int row_stride() { return D + 16 / static_cast<int>(sizeof(T)); }

template <typename T, int D>
constexpr int smem_bytes() {
  return (kRows + 2 * kKeys) * row_stride<T, D>() * static_cast<int>(sizeof(T)) +
         kRows * kPLd * static_cast<int>(sizeof(float));
}

// What the kernel needs beyond PagedPrefillArgs, computed on the host.
struct Plan {
  int group_size;       // num_q_heads / num_kv_heads
  int head_chunks;      // CTAs that split one kv head's group of query heads
  int chunk_heads;      // query heads per chunk (the last chunk may have fewer)
  int tokens_per_tile;  // kRows / chunk_heads
  int tiles;            // ceil(max_query_len / tokens_per_tile)
  int block_shift;      // log2(block_size)
  int max_tokens;       // max_blocks * block_size: context_lens are clamped to it
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));  // src-size 0: sixteen zero bytes, nothing read
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four consecutive elements of shared memory as floats (bf16 is the top half of an fp32).
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&f)[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  f[0] = __uint_as_float(w.x << 16);
  f[1] = __uint_as_float(w.x & 0xffff0000u);
  f[2] = __uint_as_float(w.y << 16);
  f[3] = __uint_as_float(w.y & 0xffff0000u);
}
__device__ __forceinline__ void load4(const __half* p, float (&f)[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  __half2 h[2];
  memcpy(h, &w, 8);
  const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}
__device__ __forceinline__ void load4(const float* p, float (&f)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  f[0] = x.x;
  f[1] = x.y;
  f[2] = x.z;
  f[3] = x.w;
}

// Max over the 8 lanes of a row group (consecutive lanes).
__device__ __forceinline__ float group8_max(float x) {
#pragma unroll
  for (int offset = 4; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float group8_sum(float x) {
#pragma unroll
  for (int offset = 4; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Two CTAs an SM (<= 128 registers a thread) where two fit in shared memory; fp32 at D = 256
// (145 KB) takes one and the registers of a whole SM half.
template <typename T, int D>
constexpr int ctas_per_sm() { return smem_bytes<T, D>() <= 80 * 1024 ? 2 : 1; }

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, ctas_per_sm<T, D>())
paged_prefill_kernel(const PagedPrefillArgs a, const Plan plan) {
  constexpr int kLd = row_stride<T, D>();
  constexpr int kVec = 16 / sizeof(T);          // elements per 16-byte copy
  constexpr int kChunksPerRow = D / kVec;       // 16-byte copies per row
  constexpr int kCols = D / 32;                 // 4-column groups of O per thread
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);          // [kRows][kLd]
  T* s_k = s_q + kRows * kLd;                   // [kKeys][kLd]
  T* s_v = s_k + kKeys * kLd;                   // [kKeys][kLd]
  float* s_p = reinterpret_cast<float*>(s_v + kKeys * kLd);  // [kRows][kPLd]

  // blockIdx.x = ((b * num_kv_heads + kv_head) * head_chunks + chunk) * tiles + (reversed tile):
  // the CTAs reading the same K/V are neighbours, and the latest (longest) tiles go first.
  int idx = blockIdx.x;
  const int tile = plan.tiles - 1 - idx % plan.tiles;
  idx /= plan.tiles;
  const int chunk = idx % plan.head_chunks;
  idx /= plan.head_chunks;
  const int kv_head = idx % a.num_kv_heads;
  const int b = idx / a.num_kv_heads;

  const int first = a.query_start_loc[b];
  const int q_len = a.query_start_loc[b + 1] - first;
  const int tok0 = tile * plan.tokens_per_tile;
  if (tok0 >= q_len) return;  // a tile past this sequence's new tokens (also q_len 0)
  const int tokens = min(plan.tokens_per_tile, q_len - tok0);
  const int ctx = min(max(a.context_lens[b], 0), plan.max_tokens);
  const int head0 = kv_head * plan.group_size + chunk * plan.chunk_heads;
  const int heads = min(plan.chunk_heads, plan.group_size - chunk * plan.chunk_heads);
  const int rows = tokens * heads;               // row r: token r / heads, head r % heads
  const int pos0 = ctx - q_len + tok0;           // the tile's first position (< 0: padding)
  const int kv_end = max(0, min(ctx, pos0 + tokens));  // keys 0 .. kv_end - 1 are read

  const int tid = threadIdx.x;
  const int rg = tid / 8;  // row group: rows rg and rg + 32
  const int cg = tid % 8;  // keys cg + 8k of a tile; O columns cg * 4 + 32j

  // Q rows, zero past `rows`.
  const T* q = static_cast<const T*>(a.q);
  for (int c = tid; c < kRows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kVec;
    const bool valid = r < rows;
    const T* src = valid ? q + (first + tok0 + r / heads) * a.q_stride_t +
                               (head0 + r % heads) * a.q_stride_h + col
                         : q;
    cp_async16(s_q + r * kLd + col, src, valid);
  }

  const int* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks;
  const int64_t token_stride = static_cast<int64_t>(a.num_kv_heads) * D;
  const int slot_mask = (1 << plan.block_shift) - 1;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * D;
  // Keys [key0, key0 + kKeys) of one cache into its tile; zeros past kv_end (table entries past
  // the context are never read).
  auto load_tile = [&](T* dst, const T* cache, int key0) {
    for (int c = tid; c < kKeys * kChunksPerRow; c += kThreads) {
      const int n = c / kChunksPerRow, col = (c % kChunksPerRow) * kVec;
      const int key = key0 + n;
      const bool valid = key < kv_end;
      const T* src = cache;
      if (valid) {
        const int64_t block = __ldg(table + (key >> plan.block_shift));
        src = cache + ((block << plan.block_shift) + (key & slot_mask)) * token_stride + head_offset + col;
      }
      cp_async16(dst + n * kLd + col, src, valid);
    }
  };
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  load_tile(s_k, k_cache, 0);
  cp_async_commit();  // group: Q and K tile 0

  // Each row's last visible key (its position); -1 for rows past `rows`, which see nothing.
  int limit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = rg + 32 * i;
    limit[i] = r < rows ? pos0 + r / heads : -1;
  }
  const float qk_scale = a.scale * kLog2e;
  float m[2] = {kNegBig, kNegBig}, l[2] = {0.f, 0.f};  // l: this thread's share of the row sum
  float acc[2][kCols * 4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int e = 0; e < kCols * 4; ++e) acc[i][e] = 0.f;
  }

  const int num_tiles = (kv_end + kKeys - 1) / kKeys;
  for (int kt = 0; kt < num_tiles; ++kt) {
    const int key0 = kt * kKeys;
    load_tile(s_v, v_cache, key0);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K tile kt are in
    __syncthreads();

    float s[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[i][k] = 0.f;
    }
#pragma unroll 8
    for (int d = 0; d < D; d += 4) {
      float qf[2][4], kf[4][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) load4(s_q + (rg + 32 * i) * kLd + d, qf[i]);
#pragma unroll
      for (int k = 0; k < 4; ++k) load4(s_k + (cg + 8 * k) * kLd + d, kf[k]);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[i][k] = fmaf(qf[i][e], kf[k][e], s[i][k]);
        }
      }
    }

    // Causal mask and online softmax; the 8 lanes of a row group hold the row's 32 scores.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        s[i][k] = key0 + cg + 8 * k <= limit[i] ? s[i][k] * qk_scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[i][k]);
      }
      const float new_max = fmaxf(m[i], group8_max(tile_max));
      const float alpha = exp2f(m[i] - new_max);
      m[i] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float p = exp2f(s[i][k] - new_max);  // 0 for a masked key
        s_p[(rg + 32 * i) * kPLd + cg + 8 * k] = p;
        sum += p;
      }
      l[i] = l[i] * alpha + sum;
#pragma unroll
      for (int e = 0; e < kCols * 4; ++e) acc[i][e] *= alpha;
    }
    __syncthreads();  // K tile read by all, P written

    if (kt + 1 < num_tiles) load_tile(s_k, k_cache, key0 + kKeys);
    cp_async_commit();   // possibly empty: keeps the group count uniform
    cp_async_wait<1>();  // V tile kt is in
    __syncthreads();

#pragma unroll 2
    for (int n = 0; n < kKeys; n += 4) {
      float p[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) load4(s_p + (rg + 32 * i) * kPLd + n, p[i]);
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          float vf[4];
          load4(s_v + (n + nn) * kLd + cg * 4 + 32 * j, vf);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j * 4 + e] = fmaf(p[i][nn], vf[e], acc[i][j * 4 + e]);
          }
        }
      }
    }
    __syncthreads();  // V tile and P read by all before the next tile overwrites them
  }
  cp_async_wait<0>();

  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = rg + 32 * i;
    const float total = group8_sum(l[i]);
    if (r >= rows) continue;
    const float inv = total > 0.f ? 1.f / total : 0.f;  // a row before position 0: zeros
    T* dst = out + (first + tok0 + r / heads) * a.out_stride_t + (head0 + r % heads) * a.out_stride_h;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      Vec<T, 4> v;
#pragma unroll
      for (int e = 0; e < 4; ++e) v.v[e] = from_float<T>(acc[i][j * 4 + e] * inv);
      *reinterpret_cast<Vec<T, 4>*>(dst + cg * 4 + 32 * j) = v;
    }
  }
}

int log2_exact(int x) {
  int shift = 0;
  while ((1 << shift) < x) ++shift;
  return shift;
}

template <typename T, int D>
cudaError_t launch(const PagedPrefillArgs& a, const Plan& plan, int64_t ctas, cudaStream_t stream) {
  constexpr int bytes = smem_bytes<T, D>();
  if (bytes > 48 * 1024) {
    // Per device and function; not a stream operation, so allowed under graph capture.
    const cudaError_t err = cudaFuncSetAttribute(
        paged_prefill_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
  }
  paged_prefill_kernel<T, D><<<static_cast<unsigned>(ctas), kThreads, bytes, stream>>>(a, plan);
  return cudaGetLastError();
}

}  // namespace

cudaError_t paged_prefill_attention(const PagedPrefillArgs& a, DType dtype, cudaStream_t stream) {
  if (a.batch == 0 || a.num_q_heads == 0 || a.max_query_len == 0) return cudaSuccess;
  if (a.max_query_len < 0 || a.max_blocks < 1 || a.num_kv_heads < 1 ||
      a.num_q_heads % a.num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  Plan plan;
  plan.group_size = a.num_q_heads / a.num_kv_heads;
  plan.head_chunks = (plan.group_size + kMaxChunkHeads - 1) / kMaxChunkHeads;
  plan.chunk_heads = (plan.group_size + plan.head_chunks - 1) / plan.head_chunks;
  plan.tokens_per_tile = kRows / plan.chunk_heads;
  plan.tiles = (a.max_query_len + plan.tokens_per_tile - 1) / plan.tokens_per_tile;
  plan.block_shift = log2_exact(a.block_size);
  plan.max_tokens = a.max_blocks * a.block_size;
  const int64_t ctas =
      static_cast<int64_t>(a.batch) * a.num_kv_heads * plan.head_chunks * plan.tiles;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;

  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (a.head_dim) {
      case 64: return launch<T, 64>(a, plan, ctas, stream);
      case 128: return launch<T, 128>(a, plan, ctas, stream);
      case 256: return launch<T, 256>(a, plan, ctas, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace pagedkv::kernels
