// How fast can a kernel read W3's K/V from an H100's memory, by load structure? A diagnostic for
// issue 4 (paged decode stays 3-5% under dense SDPA from 16x4096 up while its loads alone read no
// faster than the whole kernel). No arithmetic: each lane folds what it reads into one xor
// (`compute` adds stand-in FMAs and shuffles per piece, below).
//
// For each W3 point (bf16, 8 kv heads, head_dim 128, block 16) and layout:
//   dense:   each (sequence, kv head) stream of K (and of V) is contiguous, [B, Hkv, S, D], the
//            layout dense SDPA reads in bench_attention.py;
//   paged:   token-major blocks [num_blocks, 16, Hkv, D] (pagedkv's cache) in shuffled order
//            through a block table;
//   paged-hm: head-major blocks [num_blocks, Hkv, 16, D] (a kv head's block is 4 KB in one run),
//            shuffled the same way,
// it times, per structure:
//   regs U:       a warp issues U 16-byte loads per lane into registers, then folds them (the
//                 block table is read right before each load here, where the decode kernel
//                 reads it an iteration ahead: these variants are a floor for the kernel);
//   regs2 U:      the same software-pipelined (the next U issued before the current are folded):
//                 the paged decode kernel's structure is regs2 8 at 3 CTAs of 4 warps per SM;
//   regsdb U:     regs2 with two register buffers taking turns (the next U issued before the
//                 wait for the current: two iterations in flight while a warp waits);
//   ring SxU:     cp.async into a per-warp shared-memory ring of S stages of U loads per lane
//                 (warp-private: no CTA barrier), folded from shared memory;
//   ring SxU heads: the same ring, but a CTA's 4 warps take 4 adjacent heads over every token of
//                 a quarter of the split (1 KB of each token-major row of 8 heads per CTA);
// at 1-4 CTAs of 128 threads per SM (held by dynamic shared memory) and 1 or more splits of each
// stream across CTAs. GB/s counts the K and V bytes read. Each time is the median over 20 event
// pairs around 10 launches back to back (so launch gaps are amortized, as in bench_attention.py's
// CUDA-graph replays; consecutive launches read the same bytes, far past the 50 MB L2 at the
// points below but 1x32768's).
//
//   nvcc -O3 -gencode=arch=compute_90,code=sm_90 -Icsrc -o read_probe lab/read_probe.cu
//   ./read_probe > read_probe.md; ./read_probe compute > read_probe_compute.md
//   ./read_probe tables [random] > read_probe_tables.md  (block orders: shuffled, sequential,
//   64-block runs; random: K/V of random bits instead of constant bytes)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "probe_common.h"
#include "kernels/common.cuh"
#include "kernels/mma.cuh"

using pagedkv::kernels::cp_async16_stream;  // the decode kernel's K/V copy and load, timed
using pagedkv::kernels::load16_stream;      // here as they are

constexpr int kHkv = 8, kRowBytes = 256, kBlock = 16, kThreads = 128, kWarps = kThreads / 32;

struct Shape {
  const int* table;   // [B, max_blocks] physical blocks (paged)
  const char* k;      // K bytes
  const char* v;      // V bytes
  int batch, ctx, max_blocks, splits, layout;  // layout: 0 dense, 1 paged, 2 paged-hm
  unsigned* sink;
};


// Byte offset of token t's 16-byte piece `sub` for stream (b, h).
__device__ __forceinline__ int64_t offset(const Shape& s, int b, int h, int t, int sub) {
  if (s.layout != 0) {
    const int64_t block = __ldg(s.table + static_cast<int64_t>(b) * s.max_blocks + (t >> 4));
    const int64_t row = s.layout == 1 ? (block * kBlock + (t & 15)) * kHkv + h   // token-major
                                      : (block * kHkv + h) * kBlock + (t & 15);  // head-major
    return row * kRowBytes + sub * 16;
  }
  return ((static_cast<int64_t>(b) * kHkv + h) * s.ctx + t) * kRowBytes + sub * 16;
}

struct Work {
  int b, h, begin, end;
};
__device__ __forceinline__ Work work_of(const Shape& s) {
  const int split = blockIdx.x % s.splits;
  const int stream = blockIdx.x / s.splits;
  const int per = (s.ctx / s.splits + kBlock - 1) / kBlock * kBlock;
  Work w{stream / kHkv, stream % kHkv, split * per, min(split * per + per, s.ctx)};
  return w;
}
// The same number of CTAs, each 4 heads of one sequence (warp w: head h + w, every token of the
// CTA's range) over a quarter of the split's tokens: per token the CTA reads 4 adjacent rows
// (1 KB of a token-major block), where work_of's CTA reads one head's rows.
__device__ __forceinline__ Work work_of_heads(const Shape& s) {
  const int quarters = 4 * s.splits;
  const int split = blockIdx.x % quarters;
  const int stream = blockIdx.x / quarters;
  const int per = (s.ctx / quarters + kBlock - 1) / kBlock * kBlock;
  Work w{stream / (kHkv / kWarps), stream % (kHkv / kWarps) * kWarps, split * per,
         min(split * per + per, s.ctx)};
  return w;
}

// What a lane does with a 16-byte piece: fold it into one word (W = 0), or first run W FMAs on
// it in 4 independent chains and X warp shuffles, a stand-in for the decode kernel's arithmetic
// (~56 instructions a piece at W3's shapes, ~4 of them shuffles) that holds the warp between its
// waits.
template <int W, int X = 0>
__device__ __forceinline__ unsigned work(const uint4& x) {
  if constexpr (W == 0) {
    return x.x ^ x.y ^ x.z ^ x.w;
  } else {
    float a = __uint_as_float(x.x), b = __uint_as_float(x.y), c = __uint_as_float(x.z),
          d = __uint_as_float(x.w);
#pragma unroll
    for (int i = 0; i < W / 4; ++i) {
      a = fmaf(a, 0.999f, 1e-3f);
      b = fmaf(b, 0.999f, 1e-3f);
      c = fmaf(c, 0.999f, 1e-3f);
      d = fmaf(d, 0.999f, 1e-3f);
    }
#pragma unroll
    for (int i = 0; i < X; ++i) a += __shfl_xor_sync(0xffffffffu, b, 1 << (i % 4));
    return __float_as_uint(a + b + c + d);
  }
}

// U loads per lane per iteration: U / 2 tokens' K and V pieces for each half-warp (16 lanes per
// 256-byte row, 2 rows side by side), so a warp covers U tokens per iteration. kPipeline: 0 loads
// then folds; 1 (regs2) issues the next U before folding the current, through a copy of the
// current that waits for them first; 2 (regsdb) two register buffers take turns (the loop
// unrolled by two), so the next U are issued before the wait for the current: two iterations in
// flight while a warp waits, as in a 2-stage ring.
template <int U, int kPipeline, int W = 0, int X = 0>
__global__ void __launch_bounds__(kThreads) regs_kernel(Shape s) {
  const Work w = work_of(s);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int side = lane / 16, sub = lane % 16;
  unsigned acc = 0;
  uint4 k0[U / 2], v0[U / 2], k1[U / 2], v1[U / 2];
  auto issue = [&](uint4 (&kr)[U / 2], uint4 (&vr)[U / 2], int base) {
#pragma unroll
    for (int j = 0; j < U / 2; ++j) {
      const int t = min(base + 2 * j + side, w.end - 1);
      const int64_t off = offset(s, w.b, w.h, t, sub);
      kr[j] = load16_stream(s.k + off);
      vr[j] = load16_stream(s.v + off);
    }
  };
  auto fold = [&](const uint4 (&k)[U / 2], const uint4 (&v)[U / 2]) {
#pragma unroll
    for (int j = 0; j < U / 2; ++j) acc ^= work<W, X>(k[j]) ^ work<W, X>(v[j]);
  };
  constexpr int kStride = kWarps * U;
  int t0 = w.begin + warp * U;
  if (kPipeline > 0 && t0 < w.end) issue(k0, v0, t0);
  if constexpr (kPipeline == 2) {
    for (; t0 < w.end; t0 += 2 * kStride) {
      const int t1 = t0 + kStride;
      if (t1 < w.end) issue(k1, v1, t1);
      fold(k0, v0);
      if (t1 >= w.end) break;
      if (t1 + kStride < w.end) issue(k0, v0, t1 + kStride);
      fold(k1, v1);
    }
  } else {
    for (; t0 < w.end; t0 += kStride) {
      if (kPipeline == 0) issue(k0, v0, t0);
#pragma unroll
      for (int j = 0; j < U / 2; ++j) k1[j] = k0[j], v1[j] = v0[j];
      if (kPipeline == 1 && t0 + kStride < w.end) issue(k0, v0, t0 + kStride);
      fold(k1, v1);
    }
  }
  if (acc == 0x9e3779b9u) s.sink[blockIdx.x] = acc;  // never: keeps the loads
}

// A warp-private ring: S stages, each U 16-byte pieces per lane (U tokens per warp). A lane reads
// back only what it copied, so its own wait_group is all the synchronisation needed.
// kHeadWarps: the CTA's warps take heads (work_of_heads) instead of stripes of tokens.
template <int S, int U, int W = 0, int X = 0, bool kHeadWarps = false>
__global__ void __launch_bounds__(kThreads) ring_kernel(Shape s) {
  extern __shared__ uint4 ring[];  // [kWarps][S][U][32]
  Work w = kHeadWarps ? work_of_heads(s) : work_of(s);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int side = lane / 16, sub = lane % 16;
  uint4* mine = ring + static_cast<int64_t>(warp) * S * U * 32 + lane;
  unsigned acc = 0;
  if (kHeadWarps) w.h += warp;
  constexpr int kStride = kHeadWarps ? U : kWarps * U;
  auto issue = [&](int base, int stage) {
#pragma unroll
    for (int j = 0; j < U / 2; ++j) {
      const int t = min(base + 2 * j + side, w.end - 1);
      const int64_t off = offset(s, w.b, w.h, t, sub);
      cp_async16_stream(mine + (stage * U + 2 * j) * 32, s.k + off);
      cp_async16_stream(mine + (stage * U + 2 * j + 1) * 32, s.v + off);
    }
  };
  const int first = w.begin + (kHeadWarps ? 0 : warp * U);
  // Prologue: S - 1 stages in flight (empty groups past the end keep the count uniform).
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (first + st * kStride < w.end) issue(first + st * kStride, st);
    asm volatile("cp.async.commit_group;");
  }
  int stage = 0;
  for (int t0 = first; t0 < w.end; t0 += kStride) {
    const int ahead = t0 + (S - 1) * kStride;
    if (ahead < w.end) issue(ahead, (stage + S - 1) % S);
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1));
#pragma unroll
    for (int j = 0; j < U; ++j) {
      acc ^= work<W, X>(mine[(stage * U + j) * 32]);
    }
    stage = (stage + 1) % S;
  }
  asm volatile("cp.async.wait_all;");
  if (acc == 0x9e3779b9u) s.sink[blockIdx.x] = acc;
}

// Random 32-bit words (a hash of the index and seed).
__global__ void fill_random(uint32_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = random_bits(i, seed);
  }
}

struct Variant {
  const char* name;
  void (*kernel)(Shape);
  int own_smem;  // bytes of shared memory the structure itself uses per CTA
};

template <int U, int kPipeline, int W = 0, int X = 0>
Variant regs(const char* name) {
  return {name, regs_kernel<U, kPipeline, W, X>, 0};
}
template <int S, int U, int W = 0, int X = 0, bool kHeadWarps = false>
Variant ring(const char* name) {
  return {name, ring_kernel<S, U, W, X, kHeadWarps>, kWarps * S * U * 32 * 16};
}

float time_ms(const Variant& var, const Shape& s, int ctas_per_sm, int smem_per_sm) {
  // Shared memory per CTA so that at most ctas_per_sm fit on an SM (1 KB per CTA is reserved).
  int smem = std::max(var.own_smem, smem_per_sm / ctas_per_sm - 1024 - 256);
  if (ctas_per_sm * (std::max(var.own_smem, 0) + 1024) > smem_per_sm) return -1.f;
  CHECK(cudaFuncSetAttribute(var.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int fit = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, var.kernel, kThreads, smem));
  if (fit != ctas_per_sm) return -1.f;
  const int grid = s.batch * kHkv * s.splits;
  constexpr int kLaunches = 10;
  return 1e-3f * median_launch_us(
      [&] { for (int i = 0; i < kLaunches; ++i) var.kernel<<<grid, kThreads, smem>>>(s); },
      kLaunches);
}

int main(int argc, char** argv) {
  // "compute": the paged layout at 3 CTAs per SM (the decode kernel's W3 occupancy), each
  // structure with 0 or 48 FMAs a piece and 0, 4 or 8 shuffles: does arithmetic between the
  // waits cost a ring its lead over registers?
  const bool compute = argc > 1 && std::strcmp(argv[1], "compute") == 0;
  // "tables": the paged layouts through three block orders (shuffled, sequential, shuffled only
  // within runs of 64 blocks, 2 MB of token-major K: the pages a TLB entry maps stay those of the
  // sequential order) at 3-4 CTAs per SM: is the paged cost the layout, the table or the scatter?
  const bool tables = argc > 1 && std::strcmp(argv[1], "tables") == 0;
  // "random" (after the mode): K/V filled with random bits instead of constant bytes (the bits a
  // model's cache holds; DRAM moves both equally fast only if the data does not matter).
  const bool random = argc > 2 && std::strcmp(argv[2], "random") == 0;
  int smem_per_sm = 0, sms = 0;
  CHECK(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# read_probe: %s, %d SMs, %d KB shared memory per SM\n\n", prop.name, sms,
              smem_per_sm / 1024);

  const std::vector<Variant> variants =
      compute ? std::vector<Variant>{regs<8, 1, 0>("regs2 8"),
                                     regs<8, 1, 48>("regs2 8 +48"),
                                     regs<8, 1, 48, 4>("regs2 8 +48 +4 shfl"),
                                     regs<8, 1, 48, 8>("regs2 8 +48 +8 shfl"),
                                     regs<8, 2>("regsdb 8"),
                                     regs<8, 2, 48, 4>("regsdb 8 +48 +4 shfl"),
                                     ring<2, 8, 0>("ring 2x8"),
                                     ring<2, 8, 48>("ring 2x8 +48"),
                                     ring<2, 8, 48, 4>("ring 2x8 +48 +4 shfl"),
                                     ring<2, 8, 48, 8>("ring 2x8 +48 +8 shfl"),
                                     ring<4, 8, 48, 4>("ring 4x8 +48 +4 shfl")}
      : tables ? std::vector<Variant>{regs<8, 1>("regs2 8"), ring<2, 8>("ring 2x8")}
              : std::vector<Variant>{regs<8, 0>("regs 8"),   regs<32, 0>("regs 32"),
                                     regs<8, 1>("regs2 8"),   regs<16, 1>("regs2 16"),
                                     regs<8, 2>("regsdb 8"),   regs<16, 2>("regsdb 16"),
                                     ring<2, 8>("ring 2x8"),     ring<4, 8>("ring 4x8"),
                                     ring<4, 16>("ring 4x16"),
                                     ring<2, 8, 0, 0, true>("ring 2x8 heads")};
  struct Point {
    int batch, ctx;
    std::vector<int> splits;
  };
  const std::vector<Point> points = {{16, 4096, {1, 3}}, {64, 2048, {1, 3}}, {256, 1024, {1, 2}},
                                     {1, 32768, {48}}};
  std::mt19937 rng(0);
  for (const Point& p : points) {
    const int max_blocks = p.ctx / kBlock, num_blocks = p.batch * max_blocks;
    const size_t bytes = static_cast<size_t>(num_blocks) * kBlock * kHkv * kRowBytes;
    // Block orders: [0] shuffled (every mode), [1] sequential, [2] shuffled within 64-block runs.
    std::vector<std::vector<int>> orders(tables ? 3 : 1, std::vector<int>(num_blocks));
    for (auto& order : orders) std::iota(order.begin(), order.end(), 0);
    std::shuffle(orders[0].begin(), orders[0].end(), rng);
    if (tables) {
      for (int run = 0; run < num_blocks; run += 64) {
        const auto first = orders[2].begin() + run;
        std::shuffle(first, first + std::min(64, num_blocks - run), rng);
      }
    }
    int* d_table;
    char *k, *v;
    unsigned* sink;
    CHECK(cudaMalloc(&d_table, orders.size() * num_blocks * sizeof(int)));
    for (size_t o = 0; o < orders.size(); ++o) {
      CHECK(cudaMemcpy(d_table + o * num_blocks, orders[o].data(), num_blocks * sizeof(int),
                       cudaMemcpyHostToDevice));
    }
    CHECK(cudaMalloc(&k, bytes));
    CHECK(cudaMalloc(&v, bytes));
    if (random) {
      fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(k), bytes / 4, 1);
      fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(v), bytes / 4, 2);
      CHECK(cudaGetLastError());
    } else {
      CHECK(cudaMemset(k, 1, bytes));
      CHECK(cudaMemset(v, 2, bytes));
    }
    CHECK(cudaMalloc(&sink, 1 << 20));
    std::printf("## %dx%d (K+V %.0f MB), GB/s\n\n", p.batch, p.ctx, 2.0 * bytes / 1e6);
    std::printf("| layout | table | splits | CTAs/SM |");
    for (const Variant& var : variants) std::printf(" %s |", var.name);
    std::printf("\n|---|---|---|---|");
    for (size_t i = 0; i < variants.size(); ++i) std::printf("---|");
    std::printf("\n");
    const char* layouts[] = {"dense", "paged", "paged-hm"};
    const char* order_names[] = {"shuffled", "sequential", "64-block runs"};
    const int min_per_sm = compute || tables ? 3 : 1, max_per_sm = compute ? 3 : 4;
    for (int layout = compute ? 1 : 0; layout < (compute ? 2 : 3); ++layout) {
      for (size_t o = 0; o < (layout == 0 ? 1 : orders.size()); ++o) {
        for (int splits : p.splits) {
          for (int per_sm = min_per_sm; per_sm <= max_per_sm; ++per_sm) {
            Shape s{d_table + o * num_blocks, k, v, p.batch, p.ctx, max_blocks, splits, layout,
                    sink};
            std::printf("| %s | %s | %d | %d |", layouts[layout], layout ? order_names[o] : "-",
                        splits, per_sm);
            for (const Variant& var : variants) {
              const float ms = time_ms(var, s, per_sm, smem_per_sm);
              if (ms < 0) std::printf(" - |");
              else std::printf(" %.0f |", 2.0 * bytes / (ms * 1e-3) / 1e9);
            }
            std::printf("\n");
            std::fflush(stdout);
          }
        }
      }
    }
    std::printf("\n");
    CHECK(cudaFree(d_table));
    CHECK(cudaFree(k));
    CHECK(cudaFree(v));
    CHECK(cudaFree(sink));
  }
  return 0;
}
