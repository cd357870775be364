// CPU paged_prefill_attention: one task per (sequence, kv head) serves the kv head's whole group
// of query heads, its new tokens taken in chunks of kChunk so the score buffer stays small
// (kChunk x group x context floats). Scores in fp32, softmax sums and the weighted V sum in fp64,
// as the decode op. The metadata is validated here, since on the CPU that costs no device sync.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/table_checks.h"
#include "kernels/paged_prefill_attention_plan.h"
#include "paged_prefill_attention_checks.h"

namespace pagedkv {
namespace {

constexpr int64_t kChunk = 16;  // query tokens per pass over the context

void check_metadata(const at::Tensor& block_tables, const at::Tensor& context_lens,
                    const at::Tensor& query_start_loc, int64_t num_tokens, int64_t max_query_len,
                    int64_t block_size, int64_t num_blocks) {
  const int64_t batch = block_tables.size(0);
  const int* qsl = query_start_loc.const_data_ptr<int>();
  TORCH_CHECK(batch == 0 || (qsl[0] >= 0 && qsl[batch] <= num_tokens),
              "pagedkv: query_start_loc runs from ", qsl[0], " to ", qsl[batch],
              "; allowed: within q's 0 to ", num_tokens, " rows");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = static_cast<int64_t>(qsl[b + 1]) - qsl[b];
    TORCH_CHECK(q_len >= 0 && q_len <= max_query_len, "pagedkv: sequence ", b, " has ", q_len,
                " query tokens (query_start_loc[", b + 1, "] - query_start_loc[", b,
                "]); allowed: 0 to max_query_len = ", max_query_len);
  }
  check_tables(block_tables, context_lens, block_size, num_blocks);
}

// C: the cache's element type, T or an fp8 one whose elements read as float(x) * scale
// (k_scale, v_scale: 1 for a T cache).
template <typename T, typename C>
void paged_prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                   const at::Tensor& context_lens, const at::Tensor& query_start_loc,
                   float scale, int64_t window, float softcap, float k_scale, float v_scale,
                   const float* sinks) {
  const int64_t num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t batch = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t group = num_q_heads / num_kv_heads;
  const C* k_base = static_cast<const C*>(k_cache.const_data_ptr());
  const C* v_base = static_cast<const C*>(v_cache.const_data_ptr());
  const int* tables = block_tables.const_data_ptr<int>();
  const int* lens = context_lens.const_data_ptr<int>();
  const int* qsl = query_start_loc.const_data_ptr<int>();
  const T* q_base = q.const_data_ptr<T>();
  T* out_base = out.data_ptr<T>();
  constexpr float kMasked = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kChunk * group;
    std::vector<float> qf(max_rows * head_dim), row(head_dim), scores;
    std::vector<double> acc(max_rows * head_dim), sums(max_rows);
    std::vector<int64_t> pos(max_rows);  // each row's position in its sequence
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t ctx = lens[b], first = qsl[b], q_len = qsl[b + 1] - first;
      const int* table = tables + b * max_blocks;
      auto cache_row = [&](const C* base, int64_t t) {
        const int64_t block = table[t / block_size];
        return base + block * k_cache.stride(0) + t % block_size * k_cache.stride(1) +
               kv_head * k_cache.stride(2);
      };
      for (int64_t c = 0; c < q_len; c += kChunk) {
        const int64_t tokens = std::min(kChunk, q_len - c), rows = tokens * group;
        // Keys 0 .. the chunk's last position; a row before position 0 (a padding row: context
        // 0, one token) sees none and gets zeros.
        const int64_t keys = std::clamp<int64_t>(ctx - q_len + c + tokens, 0, ctx);
        // With a window, keys before the chunk's first row's window are never read: [k0, keys).
        const int64_t k0 = window > 0 ? std::clamp<int64_t>(ctx - q_len + c - window + 1, 0, keys) : 0;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = c + r / group, h = kv_head * group + r % group;
          pos[r] = ctx - q_len + i;
          const T* src = q_base + (first + i) * q.stride(0) + h * q.stride(1);
          for (int64_t d = 0; d < head_dim; ++d) qf[r * head_dim + d] = static_cast<float>(src[d]) * scale;
        }
        scores.resize(rows * keys);
        for (int64_t t = k0; t < keys; ++t) {
          const C* k = cache_row(k_base, t);
          for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(k[d]) * k_scale;
          for (int64_t r = 0; r < rows; ++r) {
            float dot = kMasked;
            if (t <= pos[r] && (window == 0 || pos[r] - t < window)) {
              const float* qr = qf.data() + r * head_dim;
              dot = 0.f;
              for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * row[d];
              if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);
            }
            scores[r * keys + t] = dot;
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * keys;
          const int64_t seen = std::clamp<int64_t>(pos[r] + 1, 0, keys);
          const int64_t from = window > 0 ? std::clamp<int64_t>(pos[r] - window + 1, k0, seen) : 0;
          float max = seen > from ? *std::max_element(s + from, s + seen) : 0.f;
          // A sink joins the softmax as one more logit with a zero value row (HF's max includes it).
          const bool sink = sinks != nullptr && seen > from;
          const float sink_logit = sink ? sinks[kv_head * group + r % group] : 0.f;
          if (sink) max = std::max(max, sink_logit);
          double sum = sink ? std::exp(static_cast<double>(sink_logit) - max) : 0.0;
          for (int64_t t = 0; t < keys; ++t) {
            s[t] = t >= from && t < seen ? std::exp(s[t] - max) : 0.f;
            sum += s[t];
          }
          sums[r] = sum;
        }
        std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.0);
        for (int64_t t = k0; t < keys; ++t) {
          const C* v = cache_row(v_base, t);
          for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<float>(v[d]) * v_scale;
          for (int64_t r = 0; r < rows; ++r) {
            const double p = scores[r * keys + t];
            if (p == 0.0) continue;
            double* a = acc.data() + r * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = c + r / group, h = kv_head * group + r % group;
          T* dst = out_base + (first + i) * out.stride(0) + h * out.stride(1);
          const double inv = sums[r] > 0.0 ? 1.0 / sums[r] : 0.0;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[r * head_dim + d] * inv);
        }
      }
    }
  });
}

}  // namespace

// workspace is the CUDA path's (its key splits); the CPU checks it and does not need it.
void paged_prefill_attention_cpu(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens,
                                 const at::Tensor& query_start_loc, double scale,
                                 int64_t max_query_len,
                                 const std::optional<at::Tensor>& workspace,
                                 int64_t sliding_window, double logit_softcap,
                                 const std::optional<at::Tensor>& k_scale,
                                 const std::optional<at::Tensor>& v_scale,
                                 const std::optional<at::Tensor>& sinks) {
  check_paged_prefill_args(out, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           max_query_len, workspace);
  check_kv_scales(k_cache, q, k_scale, v_scale);
  check_sinks(sinks, q);
  const float* sink_logits = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  const bool fp8 = is_fp8_cache(k_cache);
  check_attention_options(sliding_window, logit_softcap);
  check_metadata(block_tables, context_lens, query_start_loc, q.size(0), max_query_len,
                 k_cache.size(1), k_cache.size(0));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_prefill_attention_cpu", [&] {
    const auto run = [&](auto cache_tag, float ks, float vs) {
      paged_prefill<scalar_t, decltype(cache_tag)>(out, q, k_cache, v_cache, block_tables,
                                                   context_lens, query_start_loc,
                                                   static_cast<float>(scale), sliding_window,
                                                   static_cast<float>(logit_softcap), ks, vs, sink_logits);
    };
    if (fp8) run(c10::Float8_e4m3fn(), k_scale->item<float>(), v_scale->item<float>());
    else run(scalar_t(), 1.f, 1.f);
  });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention_cpu);
}

// The CUDA path's split rule and workspace size are plain host code, registered for every build
// and device so callers can size the workspace (and CI can test the rule) without a GPU.
int64_t paged_prefill_num_splits(int64_t num_tokens, int64_t batch, int64_t max_query_len,
                                 int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                 at::ScalarType dtype, int64_t max_tokens, int64_t num_sms) {
  return kernels::paged_prefill_num_splits(num_tokens, batch, max_query_len, num_q_heads,
                                           num_kv_heads, head_dim, c10::elementSize(dtype),
                                           max_tokens, num_sms);
}

int64_t paged_prefill_workspace_floats(int64_t num_tokens, int64_t num_q_heads, int64_t head_dim,
                                       int64_t num_splits) {
  return kernels::paged_prefill_workspace_floats(num_tokens, num_q_heads, head_dim, num_splits);
}

TORCH_LIBRARY_IMPL(pagedkv, CompositeExplicitAutograd, m) {
  m.impl("paged_prefill_num_splits", &paged_prefill_num_splits);
  m.impl("paged_prefill_workspace_floats", &paged_prefill_workspace_floats);
}

}  // namespace pagedkv
