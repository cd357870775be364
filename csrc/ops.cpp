// Every pagedkv op is declared here, once, with a one-line comment. Arguments marked `Tensor!`
// are written by the op; ops return nothing so they can run inside CUDA graphs without
// allocating. Implementations register per device: csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cpp (CUDA).
#include <torch/library.h>

TORCH_LIBRARY(pagedkv, m) {
  // out = weight * rms_normalize(input); HF's rounding: normalize in fp32, round, then scale.
  // gemma_style: out = (1 + weight) * rms_normalize(input) in fp32, rounded once (GemmaRMSNorm).
  m.def("rms_norm(Tensor! out, Tensor input, Tensor weight, float epsilon, bool gemma_style=False) -> ()");
  // residual = input + residual; input = weight * rms_normalize(residual). Both in place.
  m.def("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon, "
        "bool gemma_style=False) -> ()");
  // Tensor parallelism: residual += sum over ranks of input (each rank's partial sums, read from
  // every rank's peer buffer at the addresses peer_buffers[r]); input = weight * rms_normalize(
  // residual). One launch instead of an all-reduce and a norm (kernels/peer_all_reduce.h).
  m.def("peer_all_reduce_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon, "
        "Tensor! buffer, int[] peer_buffers, int rank, int timeout_ms) -> ()");
  // out = x @ weight^T + bias; decode-sized x (<= 8 rows, 16-bit) streams the weight in a kernel
  // of ours at memory bandwidth, anything larger goes to cuBLAS.
  m.def("linear(Tensor! out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  // out = act(x @ gate^T) * (x @ up^T), gate_up = [gate; up] rows: the MLP's first half in one
  // op (one weight-streaming kernel for <= 8 rows of x; cuBLAS + silu_and_mul beyond);
  // activation as silu_and_mul's: "silu" or "gelu_tanh".
  m.def("gate_up_silu(Tensor! out, Tensor x, Tensor gate_up, str activation=\"silu\") -> ()");
  // out[b, h] = softmax(scale * q[b, h] . K) V over the context_lens[b] tokens block_tables[b] maps
  // to in k_cache/v_cache; workspace: fp32 split partials; num_splits 0: paged_decode_num_splits.
  // sliding_window > 0: only the last sliding_window tokens; logit_softcap > 0: scaled scores
  // capped to cap * tanh(score / cap) (both ops). k_scale, v_scale: the fp32 scales of an fp8
  // (e4m3) cache, K/V read as float(x) * scale (all three ops; None for a 16-bit cache).
  // sinks: [num_q_heads] fp32 attention sinks (GPT-OSS): one logit per head that joins each
  // row's softmax denominator and adds nothing to its output (both attention ops).
  m.def("paged_decode_attention(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, float scale, Tensor! workspace, "
        "int num_splits=0, int sliding_window=0, float logit_softcap=0.0, Tensor? k_scale=None, "
        "Tensor? v_scale=None, Tensor? sinks=None, Tensor? row_order=None) -> ()");
  // The split count the CUDA path of paged_decode_attention picks from shapes and q's dtype
  // (host only).
  m.def("paged_decode_num_splits(int batch, int num_q_heads, int num_kv_heads, int block_size, "
        "int max_blocks, int num_sms, int head_dim, ScalarType dtype) -> int");
  // The fp32 floats of paged_decode_attention's workspace for these shapes (0 without splits).
  m.def("paged_decode_workspace_floats(int batch, int num_q_heads, int head_dim, int num_splits) -> int");

  // Decode-step kernels: RoPE + KV write, SiLU*mul, sampling, block copy (csrc/kernel_checks.h).
  // q, k rotated in place (HF rotate-half; optional per-head RMSNorm first); k, v written at
  // slot_mapping (int32, -1 = skip); positions int32; cos_sin_cache [max_position, rot_dim] f32.
  // An fp8 cache stores round_to_e4m3(clamp(x / scale, -448, 448)).
  m.def("rope_and_write_kv(Tensor! q, Tensor! k, Tensor v, Tensor positions, Tensor cos_sin_cache, "
        "Tensor! k_cache, Tensor! v_cache, Tensor slot_mapping, Tensor? q_norm_weight, "
        "Tensor? k_norm_weight, float epsilon, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  // out = act(x[..., :I]) * x[..., I:] with HF's rounding (act rounded, then the product);
  // activation "silu" or "gelu_tanh" (HF's gelu_pytorch_tanh).
  m.def("silu_and_mul(Tensor! out, Tensor x, str activation=\"silu\") -> ()");
  // out[b] = argmax (temperatures absent or <= 0) or a token drawn from softmax(logits/T) under
  // top-k/top-p with the counter-based uniform of (seeds[b], offsets[b]).
  m.def("sample(Tensor! out, Tensor logits, Tensor? temperatures, Tensor? top_k, Tensor? top_p, "
        "Tensor? seeds, Tensor? offsets) -> ()");
  // For every layer l and pair i: block dst[i] of k_caches[l] and v_caches[l] = block src[i].
  m.def("copy_blocks(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor src, Tensor dst) -> ()");
  // One decode step on, for rows decoded with all their blocks reserved: tokens = next_tokens;
  // rows with context_lens > 0 move one position on (positions, context_lens, generated + 1);
  // offsets + 1; slot_mapping = the new position's slot through block_tables (-1: padding row,
  // or the position is past the row's table).
  m.def("advance_decode_rows(Tensor next_tokens, Tensor(a!) tokens, Tensor(b!) positions, "
        "Tensor(c!) context_lens, Tensor(d!) generated, Tensor(e!) offsets, "
        "Tensor(f!) slot_mapping, Tensor block_tables, int block_size) -> ()");
  // Prompt lookup kept on the device (csrc/kernels/lookup_round_rule.h): each live row's feed of
  // width = feed.shape[1] tokens (its last token, up to min(k, width - 1, max_new - generated - 1)
  // tokens that followed the first earlier match of its last n <= max_ngram tokens, filler) with
  // positions, slots and contexts through block_tables; then, after the verification forward,
  // accept the proposal's prefix that greedy repeats, append what is emitted (cut after an EOS
  // and at max_new) to history, and update lengths, generated, done and stats [rows, 3].
  // max_new [rows] int64: each row's max_new_tokens (a tensor: one captured round serves any).
  m.def("lookup_propose(Tensor history, Tensor lengths, Tensor generated, Tensor done, "
        "Tensor block_tables, Tensor(a!) feed, Tensor(b!) proposal_lens, Tensor(c!) positions, "
        "Tensor(d!) slot_mapping, Tensor(e!) context_lens, Tensor max_new, int k, int max_ngram, "
        "int block_size) -> ()");
  m.def("lookup_accept(Tensor greedy, Tensor feed, Tensor proposal_lens, Tensor eos_ids, "
        "Tensor(a!) history, Tensor(b!) lengths, Tensor(c!) generated, Tensor(d!) done, "
        "Tensor(e!) stats, Tensor max_new) -> ()");

  // Prefill/chunked-prefill attention: sequence b's new tokens are q rows [qsl[b], qsl[b+1]), the
  // last of its context_lens[b] tokens (already in the cache); each attends causally through
  // block_tables[b]. max_query_len: a host upper bound of the rows per sequence (sizes the grid).
  // workspace: fp32 split partials, needed on CUDA when paged_prefill_num_splits > 1.
  m.def("paged_prefill_attention(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor context_lens, Tensor query_start_loc, float scale, "
        "int max_query_len, Tensor(a!)? workspace=None, int sliding_window=0, "
        "float logit_softcap=0.0, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None) -> ()");
  // The key splits the CUDA path of paged_prefill_attention picks from shapes, q's dtype and the
  // SM count (host only; max_tokens = max_blocks * block_size), and the fp32 floats of its
  // workspace (0 unsplit).
  m.def("paged_prefill_num_splits(int num_tokens, int batch, int max_query_len, int num_q_heads, "
        "int num_kv_heads, int head_dim, ScalarType dtype, int max_tokens, int num_sms) -> int");
  m.def("paged_prefill_workspace_floats(int num_tokens, int num_q_heads, int head_dim, "
        "int num_splits) -> int");

  // Mixture of experts (csrc/moe_checks.h), reading only the chosen experts' weights:
  // out[t, j] = silu(x[t] @ gate^T) * (x[t] @ up^T) of expert expert_ids[t, j] (gate_up [E, 2I, D]).
  m.def("moe_gate_up_silu(Tensor! out, Tensor x, Tensor gate_up, Tensor expert_ids) -> ()");
  // out[t] = sum_j weights[t, j] * (act[t, j] @ down[expert_ids[t, j]]^T) with HF's rounding.
  m.def("moe_down_sum(Tensor! out, Tensor act, Tensor down, Tensor expert_ids, Tensor weights) -> ()");
  // The same two with FP8 experts (csrc/moe_quantized_checks.h): e4m3 gate, up [E, I, D] and down [E, D, I],
  // each with fp32 block scales [E, ceil(rows / block_n), ceil(cols / block_k)]; the dense ops' results
  // on the weights dequantized to the activations' dtype (one rounding a value).
  m.def("moe_gate_up_silu_fp8(Tensor! out, Tensor x, Tensor gate, Tensor gate_scales, Tensor up, "
        "Tensor up_scales, Tensor expert_ids, int block_n, int block_k) -> ()");
  m.def("moe_down_sum_fp8(Tensor! out, Tensor act, Tensor down, Tensor down_scales, Tensor expert_ids, "
        "Tensor weights, int block_n, int block_k) -> ()");
  // And with int4 experts (AWQ, GPTQ without desc_act, compressed-tensors W4A16): packed [E, rows, cols / 2]
  // uint8, scales [E, rows, cols / group_size] (float32/16, bfloat16), zeros likewise uint8.
  m.def("moe_gate_up_silu_int4(Tensor! out, Tensor x, Tensor gate, Tensor gate_scales, Tensor gate_zeros, "
        "Tensor up, Tensor up_scales, Tensor up_zeros, Tensor expert_ids, int group_size) -> ()");
  m.def("moe_down_sum_int4(Tensor! out, Tensor act, Tensor down, Tensor down_scales, Tensor down_zeros, "
        "Tensor expert_ids, Tensor weights, int group_size) -> ()");
  // HF's router after its linear: ids [T, k] and weights [T, k] (float32 or logits' dtype) of the
  // top-k of softmax(logits [T, E]) in fp32 (torch.topk's ties), divided by their sum if normalize.
  m.def("moe_topk(Tensor! expert_ids, Tensor! weights, Tensor logits, bool normalize) -> ()");

  // Int4 weight-only linear (csrc/linear_w4a16_checks.h): out = x @ W^T, W [n, k] =
  // (q - zeros) * scales per group of group_size input columns, q packed 8 a word in packed.
  m.def("linear_w4a16(Tensor! out, Tensor x, Tensor packed, Tensor scales, Tensor zeros, "
        "int group_size) -> ()");
  // FP8 weight linear (csrc/linear_fp8_checks.h): out = x @ W^T, W [n, k] = e4m3 weight times
  // its fp32 scale of a block_n x block_k grid (128x128, per channel or per tensor).
  m.def("linear_fp8_weight(Tensor! out, Tensor x, Tensor weight, Tensor scales, int block_n, "
        "int block_k) -> ()");
  // NF4 weight linear (csrc/linear_nf4_checks.h): out = x @ W^T, W [n, k] = code[q] * absmax
  // per block of block_size input columns, q packed two a byte (bitsandbytes' nibble order).
  m.def("linear_nf4(Tensor! out, Tensor x, Tensor packed, Tensor absmax, Tensor code, "
        "int block_size) -> ()");
  // Int8 weight linear (csrc/linear_int8_checks.h): out = x @ W^T, W [n, k] = q * scb[row] / 127
  // (bitsandbytes' LLM.int8 weight; the activations are not quantized).
  m.def("linear_int8(Tensor! out, Tensor x, Tensor q, Tensor scb) -> ()");
}
