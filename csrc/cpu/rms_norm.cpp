// CPU rms_norm / fused_add_rms_norm. Same rounding as HF's LlamaRMSNorm: accumulate in fp32,
// round the normalized value to the input dtype, then multiply by the weight and round again.
// gemma_style: HF's GemmaRMSNorm instead, the normalized value times (1 + weight) in fp32, one
// rounding at the end.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"

namespace pagedkv {
namespace {

template <typename T, bool kGemma>
void rms_norm_rows(T* out, const T* in, const T* w, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = in + r * hidden;
      T* y = out + r * hidden;
      // A sequential fp32 sum drifts by ~hidden ulps; double keeps it as exact as torch's tree sum.
      double sum_sq = 0.0;
      for (int64_t i = 0; i < hidden; ++i) {
        const double v = static_cast<float>(x[i]);
        sum_sq += v * v;
      }
      const float inv_rms =
          static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(hidden) + eps));
      for (int64_t i = 0; i < hidden; ++i) {
        if constexpr (kGemma) {
          y[i] = static_cast<T>(static_cast<float>(x[i]) * inv_rms * (1.f + static_cast<float>(w[i])));
        } else {
          const T normed = static_cast<T>(static_cast<float>(x[i]) * inv_rms);
          y[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
        }
      }
    }
  });
}

template <typename T>
void add_rows(T* x, T* residual, int64_t n) {
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      residual[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
    }
  });
}

template <typename T>
void rms_norm_rows(T* out, const T* in, const T* w, int64_t rows, int64_t hidden, float eps,
                   bool gemma_style) {
  if (gemma_style) {
    rms_norm_rows<T, true>(out, in, w, rows, hidden, eps);
  } else {
    rms_norm_rows<T, false>(out, in, w, rows, hidden, eps);
  }
}

}  // namespace

void rms_norm_cpu(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                  double epsilon, bool gemma_style) {
  check_norm_args(out, "out", input, "input", weight, epsilon);
  const int64_t hidden = input.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "rms_norm_cpu", [&] {
    rms_norm_rows(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                  weight.const_data_ptr<scalar_t>(), input.numel() / hidden, hidden,
                  static_cast<float>(epsilon), gemma_style);
  });
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                            double epsilon, bool gemma_style) {
  check_norm_args(residual, "residual", input, "input", weight, epsilon);
  const int64_t hidden = input.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "fused_add_rms_norm_cpu", [&] {
    scalar_t* x = input.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    add_rows(x, res, input.numel());
    rms_norm_rows(x, res, weight.const_data_ptr<scalar_t>(), input.numel() / hidden, hidden,
                  static_cast<float>(epsilon), gemma_style);
  });
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cpu);
}

}  // namespace pagedkv
