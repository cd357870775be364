// CPU paged_decode_attention: one task per (sequence, kv head) serves the kv head's whole group
// of query heads. Scores in fp32, softmax sums and the weighted V sum in fp64 (an 8k-token
// sequential sum in fp32 would drift past the tests' tolerance). The block table and context
// lengths are validated here, since on the CPU that costs no device synchronisation.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_checks.h"
#include "cpu/table_checks.h"
#include "kernels/paged_decode_attention_plan.h"

namespace pagedkv {
namespace {

// C: the cache's element type, T or an fp8 one whose elements read as float(x) * scale
// (k_scale, v_scale: 1 for a T cache).
template <typename T, typename C>
void paged_decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& context_lens, float scale, int64_t window, float softcap,
                  float k_scale, float v_scale, const float* sinks) {
  const int64_t batch = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_q_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const C* k_base = static_cast<const C*>(k_cache.const_data_ptr());
  const C* v_base = static_cast<const C*>(v_cache.const_data_ptr());
  const int* tables = block_tables.const_data_ptr<int>();
  const int* lens = context_lens.const_data_ptr<int>();
  const T* q_base = q.const_data_ptr<T>();
  T* out_base = out.data_ptr<T>();

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), row(head_dim), scores;
    std::vector<double> acc(group * head_dim), sums(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t ctx = lens[b];
      // The window's first key: the tokens before it are never read.
      const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - lo;
      const int* table = tables + b * max_blocks;
      auto cache_row = [&](const C* base, int64_t t) {
        const int64_t block = table[t / block_size];
        return base + block * k_cache.stride(0) + t % block_size * k_cache.stride(1) +
               kv_head * k_cache.stride(2);
      };
      for (int64_t h = 0; h < group; ++h) {
        const T* src = q_base + b * q.stride(0) + (kv_head * group + h) * q.stride(1);
        for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = static_cast<float>(src[d]) * scale;
      }
      scores.resize(group * n);
      for (int64_t t = 0; t < n; ++t) {
        const C* k = cache_row(k_base, lo + t);
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(k[d]) * k_scale;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qf.data() + h * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * row[d];
          scores[h * n + t] = softcap > 0.f ? softcap * std::tanh(dot / softcap) : dot;
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * n;
        float max = n > 0 ? *std::max_element(s, s + n) : 0.f;
        // A sink joins the softmax as one more logit with a zero value row (HF's max includes it).
        const float sink = sinks != nullptr ? sinks[kv_head * group + h] : 0.f;
        if (sinks != nullptr && n > 0) max = std::max(max, sink);
        double sum = sinks != nullptr && n > 0 ? std::exp(static_cast<double>(sink) - max) : 0.0;
        for (int64_t t = 0; t < n; ++t) {
          s[t] = std::exp(s[t] - max);
          sum += s[t];
        }
        sums[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t t = 0; t < n; ++t) {
        const C* v = cache_row(v_base, lo + t);
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(v[d]) * v_scale;
        for (int64_t h = 0; h < group; ++h) {
          const double p = scores[h * n + t];
          double* a = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        T* dst = out_base + b * out.stride(0) + (kv_head * group + h) * out.stride(1);
        const double inv = ctx > 0 ? 1.0 / sums[h] : 0.0;  // a padding row (context 0) gets zeros
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[h * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace

// workspace and num_splits are the CUDA path's; the CPU accepts and ignores them.
void paged_decode_attention_cpu(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& context_lens, double scale,
                                at::Tensor& workspace, int64_t num_splits,
                                int64_t sliding_window, double logit_softcap,
                                const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale,
                                const std::optional<at::Tensor>& sinks,
                                const std::optional<at::Tensor>& row_order) {
  check_paged_decode_args(out, q, k_cache, v_cache, block_tables, context_lens, workspace,
                          num_splits);
  // row_order orders CUDA's launch only; here it is checked (a permutation of the rows), as the
  // CPU checks block tables' contents, and computes nothing different.
  check_row_order(row_order, q);
  if (row_order) {
    std::vector<bool> seen(q.size(0), false);
    const int* rows = row_order->const_data_ptr<int>();
    for (int64_t i = 0; i < q.size(0); ++i) {
      TORCH_CHECK(rows[i] >= 0 && rows[i] < q.size(0) && !seen[rows[i]],
                  "pagedkv: row_order must be a permutation of range(", q.size(0), "); entry ", i,
                  " is ", rows[i]);
      seen[rows[i]] = true;
    }
  }
  check_kv_scales(k_cache, q, k_scale, v_scale);
  check_sinks(sinks, q);
  const float* sink_logits = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  const bool fp8 = is_fp8_cache(k_cache);
  check_attention_options(sliding_window, logit_softcap);
  check_tables(block_tables, context_lens, k_cache.size(1), k_cache.size(0));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode_attention_cpu", [&] {
    const auto run = [&](auto cache_tag, float ks, float vs) {
      paged_decode<scalar_t, decltype(cache_tag)>(out, q, k_cache, v_cache, block_tables,
                                                  context_lens, static_cast<float>(scale),
                                                  sliding_window, static_cast<float>(logit_softcap),
                                                  ks, vs, sink_logits);
    };
    if (fp8) run(c10::Float8_e4m3fn(), k_scale->item<float>(), v_scale->item<float>());
    else run(scalar_t(), 1.f, 1.f);
  });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention_cpu);
}

// The CUDA path's split heuristic and workspace layout are plain host code, registered for every
// build and device so callers can size the workspace (and CI can test the heuristic) without a GPU.
int64_t paged_decode_num_splits(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                                int64_t block_size, int64_t max_blocks, int64_t num_sms,
                                int64_t head_dim, at::ScalarType dtype) {
  const bool tensor_cores = kernels::paged_decode_tensor_cores(
      static_cast<int>(head_dim), static_cast<int>(c10::elementSize(dtype)));
  return kernels::paged_decode_num_splits(batch, num_q_heads, num_kv_heads, block_size,
                                          max_blocks, num_sms, tensor_cores, head_dim);
}

int64_t paged_decode_workspace_floats(int64_t batch, int64_t num_q_heads, int64_t head_dim,
                                      int64_t num_splits) {
  return kernels::paged_decode_workspace_floats(batch, num_q_heads, head_dim, num_splits);
}

TORCH_LIBRARY_IMPL(pagedkv, CompositeExplicitAutograd, m) {
  m.impl("paged_decode_num_splits", &paged_decode_num_splits);
  m.impl("paged_decode_workspace_floats", &paged_decode_workspace_floats);
}

}  // namespace pagedkv
