// CPU twin of peer_all_reduce_add_rms_norm: the protocol of kernels/peer_all_reduce.cu on host
// memory, for ranks that are threads of one process (the tests' stand-in for GPUs sharing
// memory): write this rank's rows into every peer's slot for it, read every other rank's rows
// from this rank's slots as they stop holding the empty marker (and empty them again), sum in
// rank order, add the residual, normalise (HF's rounding, as fused_add_rms_norm on the CPU).
// Only block 0's epoch counter of the layout is used.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "peer_all_reduce_checks.h"

namespace pagedkv {
namespace {

using kernels::PeerBufferLayout;

template <typename T>
using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;

template <typename T>
constexpr Bits<T> kMarker = static_cast<Bits<T>>(~Bits<T>{0});  // every byte 0xff

template <typename T>
std::atomic_ref<Bits<T>> element(int64_t base, size_t offset, int64_t i) {
  return std::atomic_ref<Bits<T>>(reinterpret_cast<Bits<T>*>(base + offset)[i]);
}

template <typename T>
float value_of(Bits<T> bits) {
  T x;
  std::memcpy(&x, &bits, sizeof(T));
  return static_cast<float>(x);
}

template <typename T>
void all_reduce_add_rms_norm(T* input, T* residual, const T* weight, int64_t rows, int64_t hidden,
                             float eps, c10::IntArrayRef peer_buffers, int rank, size_t data_bytes,
                             int64_t timeout_ms) {
  const int world = static_cast<int>(peer_buffers.size());
  const int64_t own = peer_buffers[rank];
  auto epoch_ref = std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(own + PeerBufferLayout::kEpochsOffset));
  const uint32_t epoch = epoch_ref.load() + 1;
  epoch_ref.store(epoch);
  const int64_t n = rows * hidden;
  const auto* in_bits = reinterpret_cast<const Bits<T>*>(input);
  const size_t sent = PeerBufferLayout::slot(epoch, rank, data_bytes, world);
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    for (int64_t i = 0; i < n; ++i) {
      const Bits<T> b = in_bits[i] == kMarker<T> ? static_cast<Bits<T>>(kMarker<T> >> 1) : in_bits[i];  // another NaN
      element<T>(peer_buffers[p], sent, i).store(b, std::memory_order_relaxed);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::vector<float> sums(static_cast<size_t>(n), 0.f);
  for (int s = 0; s < world; ++s) {  // rank order: every rank adds alike
    if (s == rank) {
      for (int64_t i = 0; i < n; ++i) sums[i] += static_cast<float>(input[i]);
      continue;
    }
    const size_t slot = PeerBufferLayout::slot(epoch, s, data_bytes, world);
    for (int64_t i = 0; i < n; ++i) {
      auto piece = element<T>(own, slot, i);
      Bits<T> b;
      while ((b = piece.load(std::memory_order_relaxed)) == kMarker<T>) {
        TORCH_CHECK(std::chrono::steady_clock::now() < deadline, "pagedkv: all-reduce of rank ", rank,
                    " waited over ", timeout_ms, " ms for rank ", s,
                    ": the tensor-parallel ranks are out of step (a rank skipped or added a step)");
        std::this_thread::yield();
      }
      piece.store(kMarker<T>, std::memory_order_relaxed);  // empty again
      sums[i] += value_of<T>(b);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* res = residual + r * hidden;
    double sum_sq = 0.0;
    for (int64_t i = 0; i < hidden; ++i) {
      const T sum = static_cast<T>(sums[r * hidden + i]);
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "peer_all_reduce_cpu", [&] {
    all_reduce_add_rms_norm(input.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            weight.const_data_ptr<scalar_t>(), rows, hidden, static_cast<float>(epsilon),
                            peer_buffers, static_cast<int>(rank), data_bytes, timeout_ms);
  });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("peer_all_reduce_add_rms_norm", &peer_all_reduce_add_rms_norm_cpu);
}

}  // namespace pagedkv
