// How fast can bulk (TMA, cp.async.bulk) copies read W3's paged K/V, with no arithmetic? A
// diagnostic for issue 4, beside lab/read_probe.cu (which times 16-byte cp.async and loads):
// in pagedkv's token-major cache [num_blocks, 16, Hkv, D] the rows of `tile` consecutive tokens
// of one block, all kv heads, are one contiguous run of tile * Hkv * D * 2 bytes, so a CTA that
// serves every kv head of a sequence can fetch them with one bulk copy for K and one for V.
//
// One warp per CTA; lane 0 keeps a ring of `stages` K and V tiles in flight (an mbarrier per
// stage counts the bytes in), the warp folds one word of each landed tile and hands the stage
// back. Work item = (sequence, split of its context). Layouts:
//   paged:  token-major blocks through a shuffled (or sequential) block table, a tile = `tile`
//           tokens x all 8 heads (tile * 2 KB);
//   dense:  [B, Hkv, S, D] (dense SDPA's tensors), an item = (sequence, head, split), a tile =
//           tile * 8 tokens of one head (the same bytes per copy, contiguous).
// GB/s counts K and V bytes; each time is the median of 20 event pairs around 10 launches.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o bulk_probe lab/bulk_probe.cu
//   ./bulk_probe [BATCH]   (one of W3's points 256x1024, 64x2048, 16x4096; all by default)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "probe_common.h"

constexpr int kHkv = 8, kRowBytes = 256, kBlock = 16;

struct Job {
  const int* table;  // [B, max_blocks]
  const char* k;
  const char* v;
  int batch, ctx, max_blocks, splits, tile, stages, dense;
  unsigned* sink;
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)));
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes));
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity));
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__global__ void __launch_bounds__(32) bulk_read(Job j) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t bars[8];
  const int lane = threadIdx.x;
  const int tile_bytes = j.tile * kHkv * kRowBytes;
  unsigned char* ring = smem;  // [stages][K, V][tile_bytes]

  int item = blockIdx.x;
  const int split = item % j.splits;
  item /= j.splits;
  const int tokens = j.ctx / j.splits;
  const int begin = split * tokens;
  // Paged: item = b; a tile is j.tile tokens of every head. Dense: item = b * Hkv + h; a tile
  // is j.tile * Hkv tokens of one head.
  const int tile_tokens = j.dense ? j.tile * kHkv : j.tile;
  const int n = tokens / tile_tokens;
  auto src_of = [&](const char* base, int i) -> const char* {
    const int t = begin + i * tile_tokens;
    if (j.dense) return base + (static_cast<int64_t>(item) * j.ctx + t) * kRowBytes;
    const int64_t block = j.table[static_cast<int64_t>(item) * j.max_blocks + t / kBlock];
    return base + ((block * kBlock + t % kBlock) * kHkv) * kRowBytes;
  };
  if (lane == 0) {
    for (int s = 0; s < j.stages; ++s) mbar_init(&bars[s]);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::);
  }
  __syncwarp();
  auto issue = [&](int i) {
    const int s = i % j.stages;
    unsigned char* k_dst = ring + (2 * s) * tile_bytes;
    mbar_expect(&bars[s], 2 * tile_bytes);
    bulk_copy(k_dst, src_of(j.k, i), tile_bytes, &bars[s]);
    bulk_copy(k_dst + tile_bytes, src_of(j.v, i), tile_bytes, &bars[s]);
  };
  if (lane == 0) {
    for (int i = 0; i < min(j.stages, n); ++i) issue(i);
  }
  unsigned acc = 0;
  for (int i = 0; i < n; ++i) {
    const int s = i % j.stages;
    mbar_wait(&bars[s], (i / j.stages) & 1);
    const unsigned char* k_tile = ring + (2 * s) * tile_bytes;
    acc ^= reinterpret_cast<const unsigned*>(k_tile)[lane] ^
           reinterpret_cast<const unsigned*>(k_tile + tile_bytes)[lane * 7];
    __syncwarp();
    if (lane == 0 && i + j.stages < n) issue(i + j.stages);
  }
  if (acc == 0x12345678u) j.sink[0] = acc;
}

float time_us(const Job& job, int ctas, int smem) {
  return median_launch_us([&] { for (int i = 0; i < 10; ++i) bulk_read<<<ctas, 32, smem>>>(job); },
                          10);
}

int main(int argc, char** argv) {
  CHECK(cudaFuncSetAttribute(bulk_read, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  struct Point {
    int batch, ctx;
  };
  const Point points[] = {{256, 1024}, {64, 2048}, {16, 4096}};
  unsigned* sink;
  CHECK(cudaMalloc(&sink, 4));
  std::printf("| point | layout | tile (tokens x 8 heads) | stages | splits | CTAs per SM | us |"
              " GB/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const Point& p : points) {
    if (argc > 1 && std::atoi(argv[1]) != p.batch) continue;  // ./bulk_probe BATCH: that point
    const int max_blocks = p.ctx / kBlock;
    const int64_t num_blocks = static_cast<int64_t>(p.batch) * max_blocks;
    const int64_t bytes = num_blocks * kBlock * kHkv * kRowBytes;  // K (V the same)
    char *k, *v;
    CHECK(cudaMalloc(&k, bytes));
    CHECK(cudaMalloc(&v, bytes));
    CHECK(cudaMemset(k, 1, bytes));
    CHECK(cudaMemset(v, 2, bytes));
    std::vector<int> shuffled(num_blocks), sequential(num_blocks);
    std::iota(sequential.begin(), sequential.end(), 0);
    shuffled = sequential;
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(7));
    int *t_shuffled, *t_sequential;
    CHECK(cudaMalloc(&t_shuffled, num_blocks * 4));
    CHECK(cudaMalloc(&t_sequential, num_blocks * 4));
    CHECK(cudaMemcpy(t_shuffled, shuffled.data(), num_blocks * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(t_sequential, sequential.data(), num_blocks * 4, cudaMemcpyHostToDevice));
    struct Config {
      const char* name;
      const int* table;
      int dense, tile, stages;
    };
    const Config configs[] = {
        {"paged, shuffled", t_shuffled, 0, 8, 2},   {"paged, shuffled", t_shuffled, 0, 8, 3},
        {"paged, shuffled", t_shuffled, 0, 4, 4},   {"paged, shuffled", t_shuffled, 0, 16, 2},
        {"paged, shuffled", t_shuffled, 0, 4, 2},   {"paged, sequential", t_sequential, 0, 8, 2},
        {"dense", t_shuffled, 1, 8, 2},             {"dense", t_shuffled, 1, 4, 4},
        {"dense", t_shuffled, 1, 4, 2},
    };
    for (const Config& c : configs) {
      const int smem = c.stages * 2 * c.tile * kHkv * kRowBytes;
      const int items = c.dense ? p.batch * kHkv : p.batch;
      const int tile_tokens = c.dense ? c.tile * kHkv : c.tile;
      int per_sm = 0;
      CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bulk_read, 32, smem));
      for (int splits : {1, 2, 4, 8, 16, 32, 64}) {
        if (p.ctx / splits < tile_tokens * c.stages) continue;
        Job j{c.table, k, v, p.batch, p.ctx, max_blocks, splits, c.tile, c.stages, c.dense, sink};
        const float us = time_us(j, items * splits, smem);
        std::printf("| %dx%d | %s | %d | %d | %d | %d | %.1f | %.0f |\n", p.batch, p.ctx, c.name,
                    c.tile, c.stages, splits, per_sm, us, 2.0 * bytes / (us * 1e-6) / 1e9);
        std::fflush(stdout);
      }
    }
    CHECK(cudaFree(k));
    CHECK(cudaFree(v));
    CHECK(cudaFree(t_shuffled));
    CHECK(cudaFree(t_sequential));
  }
  return 0;
}
