// CPU silu_and_mul with HF's rounding: silu(gate) = gate / (1 + exp(-gate)) in fp32, rounded to
// the dtype, then times up, rounded again. activation "gelu_tanh": HF's own ops,
// at::gelu(gate, "tanh") * up: torch's vectorized tanh differs from std::tanh by an ulp now and
// then, which 1 + tanh amplifies where it cancels; this way every bit is HF's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "kernel_checks.h"

namespace pagedkv {

void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& x, c10::string_view activation) {
  const bool gelu = is_gelu_tanh(activation);
  check_silu_and_mul_args(out, x);
  const int64_t intermediate = out.size(-1);
  if (gelu) {
    at::mul_out(out, at::gelu(x.narrow(-1, 0, intermediate), "tanh"), x.narrow(-1, intermediate, intermediate));
    return;
  }
  const int64_t rows = out.numel() / intermediate;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "silu_and_mul_cpu", [&] {
    using T = scalar_t;
    const T* in = x.const_data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / intermediate), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = in + r * 2 * intermediate;
        const T* up = gate + intermediate;
        for (int64_t i = 0; i < intermediate; ++i) {
          const float g = static_cast<float>(gate[i]);
          const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
          dst[r * intermediate + i] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[i]));
        }
      }
    });
  });
}

// moe_gate_up_silu's activation (cpu/moe_experts.cpp).
void silu_and_mul_cpu(at::Tensor& out, const at::Tensor& x) { silu_and_mul_cpu(out, x, "silu"); }

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("silu_and_mul",
         static_cast<void (*)(at::Tensor&, const at::Tensor&, c10::string_view)>(&silu_and_mul_cpu));
}

}  // namespace pagedkv
