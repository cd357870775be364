// CPU sample: the CUDA kernel's definitions (sample.cu) computed directly. Same order keys,
// fixed-point weights, thresholds, uniform and inverse-CDF order, so a (seed, offset) draws the
// same token as on the GPU unless a weight, computed with std::exp here and __expf there, lands
// on the other side of a boundary (a few units in 2^40).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <vector>

#include "kernel_checks.h"
#include "kernels/sample_math.h"

namespace pagedkv {
namespace {

using sampling::order_key;

struct RowParams {
  float temperature = 0.f;
  int top_k = 0;
  float top_p = 1.f;
  int64_t seed = 0;
  int64_t offset = 0;
};

struct Scratch {
  std::vector<uint32_t> keys, sorted_keys;
  std::vector<uint64_t> weights;
  std::vector<int> order;
};

template <typename T>
int64_t sample_row(const T* logits, int vocab, const RowParams& p, Scratch& s) {
  uint64_t best = 0;
  for (int i = 0; i < vocab; ++i) {
    const uint64_t packed = (static_cast<uint64_t>(order_key(static_cast<float>(logits[i]))) << 32) |
                            static_cast<uint32_t>(~i);
    best = std::max(best, packed);
  }
  const int argmax = static_cast<int>(~static_cast<uint32_t>(best));
  const uint32_t max_key = static_cast<uint32_t>(best >> 32);
  if (!(p.temperature > 0.f)) return argmax;
  if (!sampling::drawable(max_key)) return sampling::kInvalidToken;  // NaN or inf: no softmax

  const float max_logit = static_cast<float>(logits[argmax]);
  s.keys.resize(vocab);
  s.weights.resize(vocab);
  for (int i = 0; i < vocab; ++i) {
    const float x = static_cast<float>(logits[i]);
    const float scaled = x == max_logit ? 0.f : (x - max_logit) / p.temperature;
    s.keys[i] = order_key(x);
    s.weights[i] = static_cast<uint64_t>(std::exp(scaled) * sampling::kWeightScale);
  }

  uint32_t threshold = 0;
  if (p.top_k > 0 && p.top_k < vocab) {  // the k-th largest key
    s.sorted_keys = s.keys;
    std::nth_element(s.sorted_keys.begin(), s.sorted_keys.begin() + (p.top_k - 1),
                     s.sorted_keys.end(), std::greater<>());
    threshold = s.sorted_keys[p.top_k - 1];
  }
  if (p.top_p < 1.f) {  // the largest key whose weight at or above it reaches the target
    s.order.clear();
    uint64_t total = 0;
    for (int i = 0; i < vocab; ++i) {
      if (s.keys[i] >= threshold) {
        s.order.push_back(i);
        total += s.weights[i];
      }
    }
    std::sort(s.order.begin(), s.order.end(), [&](int a, int b) { return s.keys[a] > s.keys[b]; });
    const double target = sampling::top_p_target(p.top_p, total);
    uint64_t cumulative = 0;
    for (size_t j = 0; j < s.order.size();) {
      const uint32_t key = s.keys[s.order[j]];
      for (; j < s.order.size() && s.keys[s.order[j]] == key; ++j) cumulative += s.weights[s.order[j]];
      if (static_cast<double>(cumulative) >= target) {
        threshold = key;
        break;
      }
    }
  }

  uint64_t total = 0;
  for (int i = 0; i < vocab; ++i) total += s.keys[i] >= threshold ? s.weights[i] : 0;
  if (total == 0) return argmax;
  const uint64_t target = sampling::draw_target(total, sampling::uniform(p.seed, p.offset));
  uint64_t running = 0;
  for (int i = 0; i < vocab; ++i) {
    running += s.keys[i] >= threshold ? s.weights[i] : 0;
    if (running > target) return i;
  }
  return argmax;
}

}  // namespace

void sample_cpu(at::Tensor& out, const at::Tensor& logits, const std::optional<at::Tensor>& temperatures,
                const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& offsets) {
  check_sample_args(out, logits, temperatures, top_k, top_p, seeds, offsets);
  const int64_t batch = logits.size(0);
  const int vocab = static_cast<int>(logits.size(1));
  const auto row_params = [&](int64_t r) {
    RowParams p;
    if (temperatures) p.temperature = temperatures->const_data_ptr<float>()[r];
    if (top_k) p.top_k = top_k->const_data_ptr<int32_t>()[r];
    if (top_p) p.top_p = top_p->const_data_ptr<float>()[r];
    if (seeds) p.seed = seeds->const_data_ptr<int64_t>()[r];
    if (offsets) p.offset = offsets->const_data_ptr<int64_t>()[r];
    return p;
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "sample_cpu", [&] {
    at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t token =
            sample_row(logits.const_data_ptr<scalar_t>() + r * logits.stride(0), vocab, row_params(r), scratch);
        if (out.scalar_type() == at::kLong) out.data_ptr<int64_t>()[r] = token;
        else out.data_ptr<int32_t>()[r] = static_cast<int32_t>(token);
      }
    });
  });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("sample", &sample_cpu); }

}  // namespace pagedkv
