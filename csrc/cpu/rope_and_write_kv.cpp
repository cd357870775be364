// CPU rope_and_write_kv: the CUDA kernel's arithmetic, element by element. Rounding follows HF's
// `q * cos + rotate_half(q) * sin` in the model dtype T (cos/sin cast to T, each product rounded
// to T, the sum rounded to T); the optional per-head norm is HF's RMSNorm (fp32, round, scale).
// An fp8 cache gets the rounded K/V divided by their scale, clamped and rounded to e4m3.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernel_checks.h"

namespace pagedkv {
namespace {

template <typename T>
float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// x [head_dim] in place; cos/sin [rot_dim / 2]; w [head_dim] or nullptr; y: scratch [head_dim].
template <typename T>
void rope_head(T* x, const float* cos, const float* sin, int rot_dim, int head_dim, const T* w,
               float eps, float* y) {
  for (int i = 0; i < head_dim; ++i) y[i] = static_cast<float>(x[i]);
  if (w != nullptr) {
    double sum_sq = 0.0;  // as exact as torch's tree sum; see cpu/rms_norm.cpp
    for (int i = 0; i < head_dim; ++i) sum_sq += static_cast<double>(y[i]) * y[i];
    const float inv_rms = static_cast<float>(1.0 / std::sqrt(sum_sq / head_dim + eps));
    for (int i = 0; i < head_dim; ++i) {
      y[i] = round_to<T>(static_cast<float>(w[i]) * round_to<T>(y[i] * inv_rms));
    }
  }
  const int half = rot_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float cs = round_to<T>(cos[i]);
    const float sn = round_to<T>(sin[i]);
    const float a1 = y[i];
    const float a2 = y[half + i];
    y[i] = round_to<T>(round_to<T>(a1 * cs) + round_to<T>(-a2 * sn));
    y[half + i] = round_to<T>(round_to<T>(a2 * cs) + round_to<T>(a1 * sn));
  }
  for (int i = 0; i < head_dim; ++i) x[i] = static_cast<T>(y[i]);
}

// One head of an fp8 cache: round_to_e4m3(clamp(x / scale, -448, 448)), as torch's
// (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).
template <typename T>
void store_fp8(c10::Float8_e4m3fn* dst, const T* x, float scale, int head_dim) {
  for (int i = 0; i < head_dim; ++i) {
    dst[i] = static_cast<c10::Float8_e4m3fn>(std::clamp(static_cast<float>(x[i]) / scale, -448.f, 448.f));
  }
}

}  // namespace

void rope_and_write_kv_cpu(at::Tensor& q, at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& q_norm_weight,
                           const std::optional<at::Tensor>& k_norm_weight, double epsilon,
                           const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  check_rope_and_write_kv_args(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                               q_norm_weight, k_norm_weight, epsilon, k_scale, v_scale);
  const bool fp8 = is_fp8_cache(k_cache);
  const float ks = fp8 ? k_scale->item<float>() : 1.f, vs = fp8 ? v_scale->item<float>() : 1.f;
  const int64_t num_tokens = q.size(0);
  const int num_q_heads = static_cast<int>(q.size(1));
  const int num_kv_heads = static_cast<int>(k.size(1));
  const int head_dim = static_cast<int>(q.size(2));
  const int rot_dim = static_cast<int>(cos_sin_cache.size(1));
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int32_t* pos = positions.const_data_ptr<int32_t>();
  const int32_t* slots = slot_mapping.const_data_ptr<int32_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "pagedkv: positions[", t, "] = ", pos[t],
                " is outside the cos_sin_cache's [0, ", max_position, ")");
    TORCH_CHECK(slots[t] < num_slots, "pagedkv: slot_mapping[", t, "] = ", slots[t],
                " is past the cache's ", num_slots, " slots");
  }
  const float* cos_sin = cos_sin_cache.const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "rope_and_write_kv_cpu", [&] {
    using T = scalar_t;
    T* q_ptr = q.data_ptr<T>();
    T* k_ptr = k.data_ptr<T>();
    const T* v_ptr = v.const_data_ptr<T>();
    void* k_out = k_cache.data_ptr();
    void* v_out = v_cache.data_ptr();
    const T* q_w = q_norm_weight ? q_norm_weight->const_data_ptr<T>() : nullptr;
    const T* k_w = k_norm_weight ? k_norm_weight->const_data_ptr<T>() : nullptr;
    const float eps = static_cast<float>(epsilon);
    at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(head_dim);
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cos_sin + pos[t] * rot_dim;
        const float* sin = cos + rot_dim / 2;
        for (int h = 0; h < num_q_heads; ++h) {
          rope_head(q_ptr + t * q.stride(0) + h * head_dim, cos, sin, rot_dim, head_dim, q_w, eps,
                    scratch.data());
        }
        for (int h = 0; h < num_kv_heads; ++h) {
          T* k_head = k_ptr + t * k.stride(0) + h * head_dim;
          rope_head(k_head, cos, sin, rot_dim, head_dim, k_w, eps, scratch.data());
          if (slots[t] < 0) continue;  // padding: rotate, but write nothing
          const int64_t offset = (static_cast<int64_t>(slots[t]) * num_kv_heads + h) * head_dim;
          const T* v_head = v_ptr + t * v.stride(0) + h * head_dim;
          if (fp8) {
            store_fp8(static_cast<c10::Float8_e4m3fn*>(k_out) + offset, k_head, ks, head_dim);
            store_fp8(static_cast<c10::Float8_e4m3fn*>(v_out) + offset, v_head, vs, head_dim);
          } else {
            std::memcpy(static_cast<T*>(k_out) + offset, k_head, head_dim * sizeof(T));
            std::memcpy(static_cast<T*>(v_out) + offset, v_head, head_dim * sizeof(T));
          }
        }
      }
    });
  });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("rope_and_write_kv", &rope_and_write_kv_cpu); }

}  // namespace pagedkv
