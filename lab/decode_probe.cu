// Paged decode attention's kernel timed alone, without torch or the extension, so that variants of
// the kernel (a patch each) build in seconds and run side by side in one device call
// (lab/decode_probe.sh builds one binary per variant from a patched copy of csrc). A
// diagnostic for issue 4: the winners still go through lab/gpu_ab.sh (the CUDA tests and
// bench_attention.py against dense SDPA in the same run).
//
// W3's shape (bf16, 32 q / 8 kv heads, head_dim 128, block 16, shuffled physical blocks), every
// sequence at the full context. Each time is the median over 20 event pairs around 10 launches,
// the launches rotating among copies of the caches past 4x the L2 (as bench_attention.py does),
// so every launch reads K/V from memory. Each point also checks the output against a naive fp32
// kernel (max abs diff, of the first launch and of one after the timed ones), so a broken
// variant shows.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 --use_fast_math \
//        --expt-relaxed-constexpr -Icsrc -o decode_probe lab/decode_probe.cu
//   ./decode_probe [NAME] [--splits N] [--point BxC] [--graph] [--table ORDER] [--ragged]
// NAME labels the rows; --splits forces num_splits; --point runs that batch x context alone
// instead of W3's four bandwidth-bound points (e.g. under ncu); --graph times the launches as
// one CUDA graph's replays; --table orders the physical blocks: shuffled (default), sequential
// (each sequence's blocks in order, one after another), runs (shuffled within runs of 64
// blocks, 2 MB of K: the memory pages touched stay those of the sequential order) or dense (no
// paged layout at all: K and V are dense SDPA's [B, Hkv, S, D] tensors, read through the cache
// strides, a block stride of 16 rows and a table of each sequence's consecutive 16-row blocks,
// so the kernel reads the same contiguous streams as the cuDNN kernel behind dense SDPA) or
// sorted (shuffled, then each sequence's blocks in ascending physical order, gaps and all: the
// tables a per-step sort would hand the kernel); --ragged draws each sequence's
// length from [C / 8, C] instead of C (GB/s then counts the K/V read, not the cache).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "probe_common.h"
#include "kernels/paged_decode_attention.cu"  // the kernel under test, with its launcher

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kBlock = 16;
using bf16 = __nv_bfloat16;

__global__ void fill_random(bf16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = __float2bfloat16((random_bits(i, seed) & 0xffff) / 32768.f - 1.f);  // in [-1, 1)
  }
}

// Cache element strides: block, token, head (the kernel's cache_stride_*).
struct Strides {
  int64_t block, token, head;
};

// One CTA per (sequence, query head): scores in fp32 to `scores` [B, Hq, max_ctx] (sequence b's
// first lens[b]), then softmax and the weighted sum. Slow and obviously right.
__global__ void reference(const bf16* q, const bf16* k, const bf16* v, const int* table,
                          const int* lens, int max_ctx, int max_blocks, Strides st, float scale,
                          float* scores, float* out) {
  const int b = blockIdx.x / kHq, h = blockIdx.x % kHq, kv = h / (kHq / kHkv);
  const int ctx = lens[b];
  float* s = scores + static_cast<int64_t>(blockIdx.x) * max_ctx;
  auto row = [&](const bf16* cache, int t) {
    const int64_t block = table[b * max_blocks + t / kBlock];
    return cache + block * st.block + (t % kBlock) * st.token + kv * st.head;
  };
  for (int t = threadIdx.x; t < ctx; t += blockDim.x) {
    const bf16* kr = row(k, t);
    float dot = 0.f;
    for (int d = 0; d < kD; ++d) {
      dot += __bfloat162float(q[(b * kHq + h) * kD + d]) * __bfloat162float(kr[d]);
    }
    s[t] = dot * scale;
  }
  __syncthreads();
  __shared__ float s_max, s_sum;
  if (threadIdx.x == 0) {
    float m = -INFINITY, l = 0.f;
    for (int t = 0; t < ctx; ++t) m = fmaxf(m, s[t]);
    for (int t = 0; t < ctx; ++t) l += expf(s[t] - m);
    s_max = m;
    s_sum = l;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kD; d += blockDim.x) {
    float o = 0.f;
    for (int t = 0; t < ctx; ++t) o += expf(s[t] - s_max) * __bfloat162float(row(v, t)[d]);
    out[(b * kHq + h) * kD + d] = o / s_sum;
  }
}

struct Point {
  int batch, ctx;
};

enum class Order { kShuffled, kSequential, kRuns, kDense, kSorted };

void run_point(const Point& p, const char* name, int forced_splits, int sms, bool graph,
               Order order, bool ragged) {
  using namespace pagedkv::kernels;
  const int max_blocks = p.ctx / kBlock, num_blocks = p.batch * max_blocks;
  const int64_t cache_elems = int64_t{num_blocks} * kBlock * kHkv * kD;
  const double kv_bytes = 2.0 * cache_elems * sizeof(bf16);
  const int copies = std::max(1, static_cast<int>(std::ceil(4 * 50e6 / kv_bytes)));
  std::vector<bf16*> k(copies), v(copies);
  for (int c = 0; c < copies; ++c) {
    CHECK(cudaMalloc(&k[c], cache_elems * sizeof(bf16)));
    CHECK(cudaMalloc(&v[c], cache_elems * sizeof(bf16)));
    fill_random<<<1024, 256>>>(k[c], cache_elems, 2 * c + 1);
    fill_random<<<1024, 256>>>(v[c], cache_elems, 2 * c + 2);
  }
  std::vector<int> table(num_blocks), lens(p.batch, p.ctx);
  // Ragged: lengths uniform in [ctx / 8, ctx], as a serving batch's (GB/s then counts the tokens
  // read, not the cache's size).
  std::mt19937 len_rng(p.batch + 17 * p.ctx);
  for (int b = 0; ragged && b < p.batch; ++b) {
    lens[b] = std::uniform_int_distribution<int>(p.ctx / 8, p.ctx)(len_rng);
  }
  const double read_bytes =
      kv_bytes / p.ctx / p.batch * std::accumulate(lens.begin(), lens.end(), 0.0);
  std::iota(table.begin(), table.end(), 0);
  // Dense: sequence b's blocks are the 16-row pieces of its stream of head 0 in [B, Hkv, S, D]
  // (the other heads one head stride on), block index b * Hkv * max_blocks + i.
  Strides st{int64_t{kBlock} * kHkv * kD, kHkv * kD, kD};
  if (order == Order::kDense) {
    st = Strides{int64_t{kBlock} * kD, kD, int64_t{p.ctx} * kD};
    for (int i = 0; i < num_blocks; ++i) {
      table[i] = i / max_blocks * kHkv * max_blocks + i % max_blocks;
    }
  }
  std::mt19937 rng(p.batch * 7919 + p.ctx);
  if (order == Order::kShuffled || order == Order::kSorted) {
    std::shuffle(table.begin(), table.end(), rng);
  }
  for (int b = 0; order == Order::kSorted && b < p.batch; ++b) {
    std::sort(table.begin() + b * max_blocks, table.begin() + (b + 1) * max_blocks);
  }
  for (int run = 0; order == Order::kRuns && run < num_blocks; run += 64) {
    std::shuffle(table.begin() + run, table.begin() + std::min(run + 64, num_blocks), rng);
  }
  int *d_table, *d_lens;
  bf16 *q, *out;
  CHECK(cudaMalloc(&d_table, num_blocks * sizeof(int)));
  CHECK(cudaMalloc(&d_lens, p.batch * sizeof(int)));
  CHECK(cudaMemcpy(d_table, table.data(), num_blocks * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_lens, lens.data(), p.batch * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&q, p.batch * kHq * kD * sizeof(bf16)));
  CHECK(cudaMalloc(&out, p.batch * kHq * kD * sizeof(bf16)));
  fill_random<<<64, 256>>>(q, p.batch * kHq * kD, 99);

  const bool tensor_cores = paged_decode_tensor_cores(kD, sizeof(bf16));
  const int splits = forced_splits > 0 ? forced_splits
                                       : paged_decode_num_splits(p.batch, kHq, kHkv, kBlock,
                                                                 max_blocks, sms, tensor_cores, kD);
  const int64_t ws_floats = paged_decode_workspace_floats(p.batch, kHq, kD, splits);
  float* workspace = nullptr;
  if (ws_floats > 0) {
    CHECK(cudaMalloc(&workspace, ws_floats * sizeof(float)));
    CHECK(cudaMemset(workspace, 0, ws_floats * sizeof(float)));
  }
  PagedDecodeArgs a{};
  a.out = out;
  a.q = q;
  a.block_tables = d_table;
  a.context_lens = d_lens;
  a.out_stride_row = a.q_stride_row = kHq * kD;
  a.out_stride_h = a.q_stride_h = kD;
  a.cache_stride_block = st.block;
  a.cache_stride_token = st.token;
  a.cache_stride_head = st.head;
  a.batch = p.batch;
  a.num_q_heads = kHq;
  a.num_kv_heads = kHkv;
  a.head_dim = kD;
  a.block_size = kBlock;
  a.max_blocks = max_blocks;
  a.scale = 1.f / std::sqrt(static_cast<float>(kD));
  a.workspace = workspace;
  a.num_splits = splits;
  a.num_sms = sms;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto launch = [&](int c) {
    a.k_cache = k[c];
    a.v_cache = v[c];
    CHECK(paged_decode_attention(a, DType::kBFloat16, stream));
  };

  // Correctness on copy 0.
  launch(0);
  CHECK(cudaStreamSynchronize(stream));
  float *scores, *ref;
  CHECK(cudaMalloc(&scores, int64_t{p.batch} * kHq * p.ctx * sizeof(float)));
  CHECK(cudaMalloc(&ref, p.batch * kHq * kD * sizeof(float)));
  reference<<<p.batch * kHq, 128>>>(q, k[0], v[0], d_table, d_lens, p.ctx, max_blocks, st,
                                    a.scale, scores, ref);
  CHECK(cudaDeviceSynchronize());
  std::vector<bf16> got(p.batch * kHq * kD);
  std::vector<float> want(got.size());
  CHECK(cudaMemcpy(want.data(), ref, want.size() * sizeof(float), cudaMemcpyDeviceToHost));
  float diff = 0.f;
  auto check = [&] {  // the output of copy 0 against the reference, into diff
    CHECK(cudaMemcpy(got.data(), out, got.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < got.size(); ++i) {
      diff = std::max(diff, std::fabs(__bfloat162float(got[i]) - want[i]));
    }
  };
  check();

  constexpr int kLaunches = 10;
  int c = 0;
  cudaGraphExec_t exec = nullptr;
  if (graph) {  // the 10 launches as one CUDA graph, replayed (bench_attention.py's way)
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kLaunches; ++i) launch(c = (c + 1) % copies);
    CHECK(cudaStreamEndCapture(stream, &g));
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    CHECK(cudaGraphDestroy(g));
  }
  const float us = median_launch_us(
      [&] {
        if (graph) CHECK(cudaGraphLaunch(exec, stream));
        else for (int i = 0; i < kLaunches; ++i) launch(c = (c + 1) % copies);
      },
      kLaunches, stream);
  if (exec) CHECK(cudaGraphExecDestroy(exec));
  // Copy 0 again after all the timed launches: a kernel whose state (the workspace) one launch
  // leaves wrong for the next shows here, not in the first launch's check.
  launch(0);
  CHECK(cudaStreamSynchronize(stream));
  check();
  CHECK(cudaStreamDestroy(stream));
  const char* order_name[] = {"", ", sequential", ", 64-block runs", ", dense [B, Hkv, S, D]",
                              ", shuffled, each sequence's sorted"};
  std::printf("| %s%s%s%s | %dx%d | %d | %.1f | %.0f | %.2g |\n", name, graph ? " (graph)" : "",
              order_name[static_cast<int>(order)], ragged ? ", ragged" : "",
              p.batch, p.ctx, splits, us,
              read_bytes / (us * 1e-6) / 1e9, diff);
  std::fflush(stdout);

  for (int i = 0; i < copies; ++i) {
    CHECK(cudaFree(k[i]));
    CHECK(cudaFree(v[i]));
  }
  for (void* ptr : {static_cast<void*>(d_table), static_cast<void*>(d_lens), static_cast<void*>(q),
                    static_cast<void*>(out), static_cast<void*>(scores), static_cast<void*>(ref)}) {
    CHECK(cudaFree(ptr));
  }
  if (workspace) CHECK(cudaFree(workspace));
}

}  // namespace

int main(int argc, char** argv) {
  const char* name = "A";
  int forced_splits = 0;
  const char* only = nullptr;
  bool graph = false, ragged = false;
  Order order = Order::kShuffled;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--splits") == 0 && i + 1 < argc) forced_splits = std::atoi(argv[++i]);
    else if (std::strcmp(argv[i], "--point") == 0 && i + 1 < argc) only = argv[++i];
    else if (std::strcmp(argv[i], "--graph") == 0) graph = true;
    else if (std::strcmp(argv[i], "--ragged") == 0) ragged = true;
    else if (std::strcmp(argv[i], "--table") == 0 && i + 1 < argc) {
      const char* o = argv[++i];
      if (std::strcmp(o, "shuffled") == 0) order = Order::kShuffled;
      else if (std::strcmp(o, "sequential") == 0) order = Order::kSequential;
      else if (std::strcmp(o, "runs") == 0) order = Order::kRuns;
      else if (std::strcmp(o, "dense") == 0) order = Order::kDense;
      else if (std::strcmp(o, "sorted") == 0) order = Order::kSorted;
      else {
        std::fprintf(stderr, "--table takes shuffled, sequential, runs, dense or sorted, got %s\n", o);
        return 2;
      }
    }
    else name = argv[i];
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Point one{};
  if (only && (std::sscanf(only, "%dx%d", &one.batch, &one.ctx) != 2 || one.batch < 1 ||
               one.ctx < kBlock || one.ctx % kBlock != 0)) {
    std::fprintf(stderr, "--point takes BATCHxCONTEXT (context a multiple of %d), got %s\n",
                 kBlock, only);
    return 2;
  }
  std::vector<Point> points = {{1, 32768}, {16, 4096}, {64, 2048}, {256, 1024}};
  if (only) points = {one};
  for (const Point& p : points) run_point(p, name, forced_splits, sms, graph, order, ragged);
  return 0;
}
