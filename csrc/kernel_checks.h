// Argument checks of rope_and_write_kv, silu_and_mul, sample, copy_blocks and advance_decode_rows,
// shared by the CPU and CUDA implementations so both reject a bad call with the same message.
#pragma once
#include <optional>
#include <vector>

#include "attention_checks.h"
#include "checks.h"
#include "kernels/advance_decode_rows_rule.h"

namespace pagedkv {

inline void check_index_dtype(const at::Tensor& t, const char* name, bool allow_int64) {
  TORCH_CHECK(t.scalar_type() == at::kInt || (allow_int64 && t.scalar_type() == at::kLong),
              "pagedkv: ", name, " has dtype ", t.scalar_type(), "; allowed: torch.int32",
              allow_int64 ? " or torch.int64" : "");
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, "pagedkv: ", name, " has dtype ", t.scalar_type(),
              "; it must be ", dtype);
}

inline void check_vector(const at::Tensor& t, int64_t size, const char* name, const char* size_name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == size, "pagedkv: ", name, " must have shape [",
              size_name, "] = [", size, "], got ", t.sizes());
  check_contiguous(t, name);
}

// [num_tokens, heads, head_dim] with heads and head_dim packed; the token stride is free, so q,
// k and v may be views of one fused QKV output.
inline void check_token_heads(const at::Tensor& t, const char* name, int64_t num_tokens,
                              int64_t head_dim) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == num_tokens && t.size(2) == head_dim, "pagedkv: ", name,
              " must have shape [num_tokens, num_heads, head_dim] = [", num_tokens, ", *, ",
              head_dim, "], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == head_dim), "pagedkv: ", name,
              " must have its heads packed (strides [*, head_dim, 1]), got strides ", t.strides());
}

// q [T, Hq, D], k/v [T, Hkv, D], positions/slot_mapping [T] int32,
// cos_sin_cache [max_position, rot_dim] float32, caches [num_blocks, block_size, Hkv, D].
inline void check_rope_and_write_kv_args(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
    const at::Tensor& cos_sin_cache, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& q_norm_weight,
    const std::optional<at::Tensor>& k_norm_weight, double epsilon,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  check_float_dtype(q, "q");
  TORCH_CHECK(q.dim() == 3, "pagedkv: q must have shape [num_tokens, num_heads, head_dim], got ",
              q.sizes());
  const int64_t num_tokens = q.size(0);
  const int64_t head_dim = q.size(2);
  check_token_heads(q, "q", num_tokens, head_dim);
  check_token_heads(k, "k", num_tokens, head_dim);
  check_token_heads(v, "v", num_tokens, head_dim);
  check_same_shape(v, k, "v", "k");
  const int64_t num_kv_heads = k.size(1);
  TORCH_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "pagedkv: q has ", q.size(1),
              " heads and k has ", num_kv_heads, "; q's must be a multiple of k's");
  for (const auto& [t, name] : {std::pair{&k, "k"}, {&v, "v"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    if (t == &k || t == &v || !is_fp8_cache(k_cache)) check_same_dtype(*t, q, name, "q");
    check_same_device(*t, q, name, "q");
  }
  check_same_dtype(v_cache, k_cache, "v_cache", "k_cache");
  check_kv_scales(k_cache, q, k_scale, v_scale);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim,
              "pagedkv: k_cache must have shape [num_blocks, block_size, num_kv_heads, head_dim] = "
              "[*, *, ", num_kv_heads, ", ", head_dim, "], got ", k_cache.sizes());
  check_same_shape(v_cache, k_cache, "v_cache", "k_cache");
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");

  check_index_dtype(positions, "positions", false);
  check_index_dtype(slot_mapping, "slot_mapping", false);
  check_same_device(positions, q, "positions", "q");
  check_same_device(slot_mapping, q, "slot_mapping", "q");
  check_vector(positions, num_tokens, "positions", "num_tokens");
  check_vector(slot_mapping, num_tokens, "slot_mapping", "num_tokens");

  check_dtype(cos_sin_cache, at::kFloat, "cos_sin_cache");
  check_same_device(cos_sin_cache, q, "cos_sin_cache", "q");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(0) > 0 &&
                  cos_sin_cache.size(1) > 0 && cos_sin_cache.size(1) % 2 == 0 &&
                  cos_sin_cache.size(1) <= head_dim,
              "pagedkv: cos_sin_cache must have shape [max_position, rot_dim] with rot_dim even "
              "and <= head_dim = ", head_dim, ", got ", cos_sin_cache.sizes());
  check_contiguous(cos_sin_cache, "cos_sin_cache");

  for (const auto& [w, name] : {std::pair{&q_norm_weight, "q_norm_weight"}, {&k_norm_weight, "k_norm_weight"}}) {
    if (!w->has_value()) continue;
    check_same_dtype(**w, q, name, "q");
    check_same_device(**w, q, name, "q");
    check_vector(**w, head_dim, name, "head_dim");
  }
  TORCH_CHECK(epsilon >= 0.0, "pagedkv: epsilon must be >= 0, got ", epsilon);
}

// out [..., I], x [..., 2 * I], both contiguous.
inline void check_silu_and_mul_args(const at::Tensor& out, const at::Tensor& x) {
  check_float_dtype(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_same_device(out, x, "out", "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) % 2 == 0, "pagedkv: x must have an even, "
              "non-empty last dimension [..., 2 * intermediate], got shape ", x.sizes());
  std::vector<int64_t> expected = x.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), "pagedkv: out must have shape ",
              at::IntArrayRef(expected), " (x's with the last dimension halved), got ", out.sizes());
  check_contiguous(x, "x");
  check_contiguous(out, "out");
}

// silu_and_mul's activation by name: "silu" (Llama's) or "gelu_tanh" (HF's gelu_pytorch_tanh).
inline bool is_gelu_tanh(c10::string_view activation) {
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "pagedkv: activation must be "
              "'silu' or 'gelu_tanh', got '", std::string(activation), "'");
  return activation == "gelu_tanh";
}

// out [B] int32/int64; logits [B, V] (last dim contiguous); per-row parameters [B]: temperatures
// f32, top_k i32, top_p f32, seeds i64, offsets i64. seeds and offsets are needed to sample.
inline void check_sample_args(const at::Tensor& out, const at::Tensor& logits,
                              const std::optional<at::Tensor>& temperatures,
                              const std::optional<at::Tensor>& top_k,
                              const std::optional<at::Tensor>& top_p,
                              const std::optional<at::Tensor>& seeds,
                              const std::optional<at::Tensor>& offsets) {
  check_float_dtype(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "pagedkv: logits must have shape [batch, vocab] with a contiguous last dimension, "
              "got shape ", logits.sizes(), " strides ", logits.strides());
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 23), "pagedkv: vocab ", logits.size(1),
              " is too large for sample (at most 2^23 - 1)");
  const int64_t batch = logits.size(0);
  check_index_dtype(out, "out", true);
  check_same_device(out, logits, "out", "logits");
  check_vector(out, batch, "out", "batch");
  const std::tuple<const std::optional<at::Tensor>*, at::ScalarType, const char*> params[] = {
      {&temperatures, at::kFloat, "temperatures"}, {&top_k, at::kInt, "top_k"},
      {&top_p, at::kFloat, "top_p"}, {&seeds, at::kLong, "seeds"}, {&offsets, at::kLong, "offsets"}};
  for (const auto& [t, dtype, name] : params) {
    if (!t->has_value()) continue;
    check_dtype(**t, dtype, name);
    check_same_device(**t, logits, name, "logits");
    check_vector(**t, batch, name, "batch");
  }
  TORCH_CHECK(!temperatures.has_value() || (seeds.has_value() && offsets.has_value()),
              "pagedkv: sampling with temperatures needs seeds and offsets (one per row)");
}

// Per-layer caches, all [num_blocks, ...] contiguous with one shape, dtype and device; src/dst
// [N] int32 or int64 block ids.
inline void check_copy_blocks_args(const std::vector<at::Tensor>& k_caches,
                                   const std::vector<at::Tensor>& v_caches,
                                   const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(!k_caches.empty() && k_caches.size() == v_caches.size(), "pagedkv: k_caches and "
              "v_caches must be non-empty lists of equal length, got ", k_caches.size(), " and ",
              v_caches.size());
  const at::Tensor& ref = k_caches[0];
  TORCH_CHECK(ref.dim() >= 1 && ref.size(0) > 0, "pagedkv: k_caches[0] must have shape "
              "[num_blocks, ...], got ", ref.sizes());
  for (const auto* list : {&k_caches, &v_caches}) {
    const char* name = list == &k_caches ? "k_caches" : "v_caches";
    for (size_t i = 0; i < list->size(); ++i) {
      const at::Tensor& t = (*list)[i];
      const std::string item = std::string(name) + "[" + std::to_string(i) + "]";
      check_same_dtype(t, ref, item.c_str(), "k_caches[0]");
      check_same_device(t, ref, item.c_str(), "k_caches[0]");
      check_same_shape(t, ref, item.c_str(), "k_caches[0]");
      check_contiguous(t, item.c_str());
    }
  }
  check_index_dtype(src, "src", true);
  check_same_dtype(dst, src, "dst", "src");
  check_same_device(src, ref, "src", "k_caches[0]");
  check_same_device(dst, ref, "dst", "k_caches[0]");
  TORCH_CHECK(src.dim() == 1, "pagedkv: src must have shape [N], got ", src.sizes());
  check_vector(dst, src.size(0), "dst", "N");
  check_contiguous(src, "src");
}

// block_tables [B, max_blocks] int32; next_tokens, tokens, offsets [B] int64; positions,
// context_lens, generated, slot_mapping [B] int32; all contiguous on one device.
// Returns the kernel's view of the tensors once they pass.
inline kernels::DecodeRows checked_decode_rows(
    const at::Tensor& next_tokens, const at::Tensor& tokens, const at::Tensor& positions,
    const at::Tensor& context_lens, const at::Tensor& generated, const at::Tensor& offsets,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, int64_t block_size) {
  TORCH_CHECK(block_tables.dim() == 2, "pagedkv: block_tables must have shape [batch, max_blocks], "
              "got ", block_tables.sizes());
  check_dtype(block_tables, at::kInt, "block_tables");
  check_contiguous(block_tables, "block_tables");
  TORCH_CHECK(block_size > 0, "pagedkv: block_size must be > 0, got ", block_size);
  const int64_t batch = block_tables.size(0);
  const std::tuple<const at::Tensor*, at::ScalarType, const char*> rows[] = {
      {&next_tokens, at::kLong, "next_tokens"}, {&tokens, at::kLong, "tokens"},
      {&positions, at::kInt, "positions"},      {&context_lens, at::kInt, "context_lens"},
      {&generated, at::kInt, "generated"},      {&offsets, at::kLong, "offsets"},
      {&slot_mapping, at::kInt, "slot_mapping"}};
  for (const auto& [t, dtype, name] : rows) {
    check_dtype(*t, dtype, name);
    check_same_device(*t, block_tables, name, "block_tables");
    check_vector(*t, batch, name, "batch");
  }
  return kernels::DecodeRows{
      next_tokens.const_data_ptr<int64_t>(), tokens.data_ptr<int64_t>(),
      positions.data_ptr<int32_t>(),         context_lens.data_ptr<int32_t>(),
      generated.data_ptr<int32_t>(),         offsets.data_ptr<int64_t>(),
      slot_mapping.data_ptr<int32_t>(),      block_tables.const_data_ptr<int32_t>(),
      static_cast<int>(batch),               static_cast<int>(block_tables.size(1)),
      static_cast<int>(block_size)};
}

}  // namespace pagedkv
