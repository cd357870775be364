// Argument checks shared by the CPU and CUDA implementations, so both reject a bad call with the
// same message: which argument, what it was, what is allowed.
#pragma once
#include <torch/types.h>

namespace pagedkv {

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf ||
                  t.scalar_type() == at::kBFloat16,
              "pagedkv: ", name, " has dtype ", t.scalar_type(),
              "; allowed: torch.float32, torch.float16, torch.bfloat16");
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* name,
                             const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "pagedkv: ", name, " has dtype ",
              t.scalar_type(), " but ", ref_name, " has ", ref.scalar_type(),
              "; they must match");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "pagedkv: ", name, " is on ", t.device(), " but ",
              ref_name, " is on ", ref.device(), "; all tensors must be on one device");
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "pagedkv: ", name, " must be contiguous (got strides ",
              t.strides(), " for shape ", t.sizes(), "); call .contiguous() first");
}

inline void check_same_shape(const at::Tensor& t, const at::Tensor& ref, const char* name,
                             const char* ref_name) {
  TORCH_CHECK(t.sizes() == ref.sizes(), "pagedkv: ", name, " has shape ", t.sizes(), " but ",
              ref_name, " has shape ", ref.sizes(), "; they must match");
}

// input/out [..., hidden], weight [hidden]: the shared contract of both norm ops.
inline void check_norm_args(const at::Tensor& out, const char* out_name, const at::Tensor& input,
                            const char* input_name, const at::Tensor& weight, double epsilon) {
  check_float_dtype(input, input_name);
  check_same_dtype(out, input, out_name, input_name);
  check_same_dtype(weight, input, "weight", input_name);
  check_same_device(out, input, out_name, input_name);
  check_same_device(weight, input, "weight", input_name);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) > 0, "pagedkv: ", input_name,
              " must have a non-empty last (hidden) dimension, got shape ", input.sizes());
  check_same_shape(out, input, out_name, input_name);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(-1),
              "pagedkv: weight must have shape [hidden] = [", input.size(-1), "], got ",
              weight.sizes());
  check_contiguous(input, input_name);
  check_contiguous(out, out_name);
  check_contiguous(weight, "weight");
  TORCH_CHECK(epsilon >= 0.0, "pagedkv: epsilon must be >= 0, got ", epsilon);
}

}  // namespace pagedkv
