"""Types whose rotary embedding turns interleaved pairs of dimensions (2i, 2i + 1) (Helium,
ERNIE-4.5, Cohere) run natively: their q/k rows are permuted per head at load
(models/interleaved_rope.py), so the half-split rotation of ops.rope_and_write_kv computes
theirs. Tiny random models with each real model's structural features (GQA, real head_dim,
biases where the type has them, Cohere's q/k LayerNorm and logit scale, tied embeddings) give
HF's greedy tokens through generate (left-padded batch) and LLM (chunked prefill) in fp32, and
up to a near tie in bf16; what the decoders do not run is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import pagedkv
from conftest import DEVICES
from models import random_model
from pagedkv import ops
from pagedkv.models import registry
from pagedkv.models.interleaved_rope import halves_order, permute_heads
from pagedkv.models.llama import DecoderWeights, PagedDecoder
from test_engine import (assert_generate_gives_hf_tokens_up_to_near_tie, assert_llm_gives_hf_greedy_tokens,
                         assert_native_generate_gives_hf_tokens, random_prompts)

COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# name -> (model_type, config fields beyond COMMON). Helium's o_proj is hidden x hidden (4 x 64);
# ERNIE-4.5 and Cohere (Command-R) have head_dim 128; their biases on q/k/v/o.
CASES = {
    "helium": ("helium", dict(head_dim=64, attention_bias=True)),
    "ernie4_5": ("ernie4_5", dict(head_dim=128)),
    "cohere": ("cohere", dict(head_dim=128, attention_bias=True, logit_scale=0.5)),
    "cohere_qk_norm": ("cohere", dict(head_dim=128, use_qk_norm=True, logit_scale=2.0)),
    "cohere_untied_linear_rope": ("cohere", dict(head_dim=64, tie_word_embeddings=False, rope_parameters=dict(
        rope_type="linear", factor=2.0, rope_theta=10000.0))),
}
GREEDY = dict(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, **fields):
    model_type, own = CASES[name]
    return random_model(model_type, {**COMMON, **own, **fields}, device, dtype, seed, norms=True)


def weights_type(model) -> type:
    if model.config.model_type != "cohere":
        return DecoderWeights
    from pagedkv.models.cohere import CohereWeights  # Cohere's own decoder
    return CohereWeights


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_generate_gives_hf_greedy_tokens(name, device):
    model = tiny(name, device)
    assert_native_generate_gives_hf_tokens(model, weights_type(model), GREEDY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_llm_gives_hf_greedy_tokens(name, device):
    """Prompts chunked by an 8-token step budget: prefill chunks over cached context, decode rows
    in the same steps."""
    model = tiny(name, device)
    llm = pagedkv.LLM(model, max_num_seqs=3, max_num_batched_tokens=8)
    assert pagedkv.support_path(model) == "native"
    assert_llm_gives_hf_greedy_tokens(llm, model, random_prompts([5, 19, 12]), GREEDY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_gives_hf_tokens_up_to_a_near_tie(name, device):
    """bf16, where the order of roundings shows (Helium's norms: weight times the fp32 value;
    ERNIE-4.5's rotation in fp32; Cohere's LayerNorms and fp32 rotation with cos/sin rounded)."""
    model = tiny(name, device, torch.bfloat16)
    assert pagedkv.support_path(model) == "native"
    assert_generate_gives_hf_tokens_up_to_near_tie(model, GREEDY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_permuted_dimensions_turn_interleaved_rope_into_halves(head_dim, device):
    """HF's interleaved rotation (Cohere's code: cos/sin of pair (2i, 2i + 1) at frequency i),
    permuted by P, equals pagedkv's half-split rotation of the permuted input: exactly in fp32 on
    the CPU (on CUDA the compiler may fuse a multiply-add: to fp32's last bits); and rows
    permuted by permute_heads give the permuted projection."""
    from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding, apply_rotary_pos_emb
    config = AutoConfig.for_model("cohere", **COMMON, head_dim=head_dim)
    rotary = CohereRotaryEmbedding(config).to(device)
    g = torch.Generator().manual_seed(0)
    tokens, heads = 7, 3
    positions = torch.randint(0, 500, (tokens,), generator=g).to(device)
    x = torch.randn(tokens, heads, head_dim, generator=g).to(device)
    cos, sin = rotary(x, positions[None])  # [1, T, Dh], interleaved
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    expected = expected[0].transpose(0, 1)  # [T, H, Dh]
    order = halves_order(head_dim).to(device)
    table = torch.cat([cos[0, :, ::2], sin[0, :, ::2]], dim=-1).contiguous()  # [T, Dh]: row t for token t
    q = x[..., order].contiguous()
    k = x[:, :1, order].contiguous()
    cache = torch.zeros(1, tokens, 1, head_dim, device=device)
    rows = torch.arange(tokens, dtype=torch.int32, device=device)
    ops.rope_and_write_kv(q, k, k.clone(), rows, table, cache, cache.clone(), rows)
    exact = dict(rtol=0, atol=0) if device == "cpu" else {}
    torch.testing.assert_close(q, expected[..., order], **exact)
    torch.testing.assert_close(cache[0], expected[:, :1, order], **exact)
    weight = torch.randn(heads * head_dim, 32, generator=g).to(device)
    hidden = torch.randn(5, 32, generator=g).to(device)
    projected = (hidden @ weight.T).view(5, heads, head_dim)
    torch.testing.assert_close((hidden @ permute_heads(weight, head_dim).T).view(5, heads, head_dim),
                               projected[..., order])


def test_the_types_left_the_fallback():
    for model_type in ("helium", "ernie4_5", "cohere"):
        assert model_type in registry.NATIVE_MODEL_TYPES
        assert model_type not in registry.FALLBACK_MODEL_TYPES + tuple(registry.OTHER_DECODERS)


def test_the_hf_model_is_left_as_it_was():
    """The permuted rows are pagedkv's copy: HF's own forward gives the same logits after
    pagedkv took the weights; and an in-place write to q_proj is seen by the next call."""
    model = tiny("helium")
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits
    pagedkv.generate(model, ids, max_new_tokens=2, pad_token_id=0)
    assert torch.equal(model(ids).logits, before)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(-1.5)
    expected = model.generate(ids, **GREEDY)
    assert torch.equal(pagedkv.generate(model, ids, **GREEDY), expected)


@pytest.mark.parametrize("name, fields, words", [
    ("ernie4_5", dict(use_bias=True), "use_bias=True"),
    ("helium", dict(mlp_bias=True), "mlp_bias=True"),
    ("cohere", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("cohere", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)), "rope type 'dynamic'"),
])
def test_what_the_decoders_do_not_run_is_refused(name, fields, words):
    model = tiny(name, **fields)
    reason = pagedkv.unsupported_reason(model)
    assert reason is not None and words in reason, reason
    with pytest.raises(pagedkv.UnsupportedModel, match=type(model).__name__):
        pagedkv.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


@pytest.mark.parametrize("name", ["helium", "ernie4_5", "cohere"])
def test_tensor_parallel_refuses_them_by_name(name):
    with pytest.raises(pagedkv.UnsupportedModel, match=f"'{CASES[name][0]}' is not sharded"):
        pagedkv.tensor_parallel(tiny(name))


def test_llama_s_decoder_is_the_one_for_helium_and_ernie():
    for name in ("helium", "ernie4_5"):
        llm = pagedkv.LLM(tiny(name), max_num_seqs=1)
        assert type(llm.runner.decoder) is PagedDecoder
