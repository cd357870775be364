// CPU twin of peer_all_reduce_add_rms_norm: the same protocol as kernels/peer_all_reduce.cu on
// host memory, for ranks that are threads of one process (the tests' stand-in for GPUs sharing
// memory): copy this rank's rows into its buffer, announce the epoch to every rank, wait for
// theirs, sum every rank's rows in rank order, add the residual, normalise (HF's rounding, as
// fused_add_rms_norm on the CPU). Only block 0 of the layout is used.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "peer_all_reduce_checks.h"

namespace pagedkv {
namespace {

using kernels::kPeerMaxRanks;
using kernels::PeerBufferLayout;

std::atomic_ref<uint32_t> slot(int64_t base, size_t offset) {
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(base + offset));
}

template <typename T>
void reduce_rows(T* input, T* residual, const T* weight, int64_t rows, int64_t hidden, float eps,
                 const std::vector<const T*>& ranks_rows) {
  for (int64_t r = 0; r < rows; ++r) {
    T* res = residual + r * hidden;
    double sum_sq = 0.0;
    for (int64_t i = 0; i < hidden; ++i) {
      float acc = 0.f;
      for (const T* rank_rows : ranks_rows) acc += static_cast<float>(rank_rows[r * hidden + i]);
      const T sum = static_cast<T>(acc);
      res[i] = static_cast<T>(static_cast<float>(sum) + static_cast<float>(res[i]));
      const double v = static_cast<float>(res[i]);
      sum_sq += v * v;
    }
    const float inv_rms = static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(hidden) + eps));
    T* out = input + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      const T normed = static_cast<T>(static_cast<float>(res[i]) * inv_rms);
      out[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
    }
  }
}

}  // namespace

void peer_all_reduce_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                                      double epsilon, at::Tensor& buffer, c10::IntArrayRef peer_buffers,
                                      int64_t rank, int64_t timeout_ms) {
  const size_t data_bytes = check_peer_all_reduce_args(input, residual, weight, epsilon, buffer,
                                                       peer_buffers, rank, timeout_ms);
  const int64_t hidden = input.size(-1);
  const int64_t rows = input.numel() / hidden;
  if (rows == 0) return;
  const int64_t own = peer_buffers[rank];
  auto epoch_ref = slot(own, PeerBufferLayout::kEpochsOffset);
  const uint32_t epoch = epoch_ref.load() + 1;
  epoch_ref.store(epoch);
  const size_t area = PeerBufferLayout::kDataOffset + (epoch & 1u) * data_bytes;
  std::memcpy(reinterpret_cast<void*>(own + area), input.const_data_ptr(), input.nbytes());
  const int64_t world = static_cast<int64_t>(peer_buffers.size());
  for (int64_t p = 0; p < world; ++p) {
    slot(peer_buffers[p], PeerBufferLayout::kFlagsOffset + sizeof(uint32_t) * rank)
        .store(epoch, std::memory_order_release);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (int64_t p = 0; p < world; ++p) {
    auto flag = slot(own, PeerBufferLayout::kFlagsOffset + sizeof(uint32_t) * p);
    while (static_cast<int32_t>(flag.load(std::memory_order_acquire) - epoch) < 0) {
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "pagedkv: all-reduce of rank ", rank,
                  " waited over ", timeout_ms, " ms for rank ", p,
                  ": the tensor-parallel ranks are out of step (a rank skipped or added a step)");
      std::this_thread::yield();
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "peer_all_reduce_cpu", [&] {
    std::vector<const scalar_t*> ranks_rows;
    for (int64_t p = 0; p < world; ++p) ranks_rows.push_back(reinterpret_cast<const scalar_t*>(peer_buffers[p] + area));
    reduce_rows(input.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
                rows, hidden, static_cast<float>(epsilon), ranks_rows);
  });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("peer_all_reduce_add_rms_norm", &peer_all_reduce_add_rms_norm_cpu);
}

}  // namespace pagedkv
