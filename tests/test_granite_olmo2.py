"""Granite and OLMo-2 on pagedkv's own decoders (Granite: models/llama.py with its multipliers;
OLMo-2: models/olmo2.py): tiny random models with the real structural features (GQA, biases,
Granite's embedding/residual/attention multipliers and logits scaling all far from 1, OLMo-2's
post-norms and q/k norms over all heads, norm weights jittered) give HF's greedy tokens through
generate (batch of 2, left padded) and LLM (chunked prefill), in fp32 exactly and in bf16 up to
a near tie, and hold no block after; what the decoders do not run is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pagedkv
import tp_worker
from conftest import DEVICES
from models import random_model
from pagedkv.models import olmo2, registry
from pagedkv.models.llama import DecoderWeights, PagedDecoder
from pagedkv.runtime.model import prepared
from test_engine import (assert_generate_gives_hf_tokens_up_to_near_tie, assert_llm_gives_hf_greedy_tokens,
                         assert_native_generate_gives_hf_tokens, random_prompts)

COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_bias=True)
MULTIPLIERS = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.05, logits_scaling=4.0)
# name -> (model_type, config fields beyond COMMON)
CASES = {"granite": ("granite", MULTIPLIERS), "olmo2": ("olmo2", {})}
WEIGHTS = {"granite": DecoderWeights, "olmo2": olmo2.Olmo2Weights}
DECODERS = {"granite": PagedDecoder, "olmo2": olmo2.Olmo2Decoder}
GREEDY = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0, **fields):
    model_type, own = CASES[name]
    return random_model(model_type, {**COMMON, **own, **fields}, device, dtype, seed, norms=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_generate_gives_hf_greedy_tokens(name, device):
    assert_native_generate_gives_hf_tokens(tiny(name, device), WEIGHTS[name], GREEDY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_llm_gives_hf_greedy_tokens(name, device):
    """Prompts chunked by an 8-token step budget: prefill chunks over cached context, decode rows
    in the same steps."""
    model = tiny(name, device)
    prompts = random_prompts([5, 19, 12])
    llm = pagedkv.LLM(model, max_num_seqs=3, max_num_batched_tokens=8)
    assert type(llm.runner.decoder) is DECODERS[name]
    assert_llm_gives_hf_greedy_tokens(llm, model, prompts, GREEDY)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_bf16_gives_hf_tokens_up_to_a_near_tie(name, device):
    """bf16, where the order of roundings shows (Granite's multipliers, each rounded as HF does;
    OLMo-2's norms, weight times the fp32 value, and its rotation in fp32, each rounded once)."""
    model = tiny(name, device, torch.bfloat16)
    assert_generate_gives_hf_tokens_up_to_near_tie(model, GREEDY)


@pytest.mark.parametrize("device", DEVICES)
def test_logits_scaling_is_in_the_logits(device):
    """Dividing the logits is monotonic (greedy tokens cannot show it): the logits are HF's."""
    model = tiny("granite", device)
    ids, mask = tp_worker.left_padded([5, 19], 256, device, seed=1)
    kw = dict(GREEDY, max_new_tokens=4, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, attention_mask=mask, **kw).logits
    got = pagedkv.generate(model, ids, attention_mask=mask, **kw).logits
    for ours, hf in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("field", ["embedding_multiplier", "residual_multiplier", "attention_multiplier"])
def test_each_multiplier_changes_the_tokens(field):
    """Each multiplier matters for these models: at 1.0 HF's tokens differ, so the greedy tests
    catch a decoder that left one out."""
    ids, mask = tp_worker.left_padded([5, 19], 256, "cpu", seed=1)
    scaled = tiny("granite").generate(ids, attention_mask=mask, **GREEDY)
    plain = tiny("granite", **{field: 1.0}).generate(ids, attention_mask=mask, **GREEDY)
    assert not torch.equal(scaled, plain)


def test_llama_s_path_is_unchanged_by_the_multipliers():
    """Other Llama-family types keep multipliers of 1 (the forward skips them)."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **COMMON))
    pagedkv.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=1)
    w = prepared(model).weights
    assert (w.embedding_multiplier, w.residual_multiplier, w.logits_scaling) == (1.0, 1.0, 1.0)


def test_native_types_left_the_fallback():
    for model_type in ("granite", "olmo2"):
        assert model_type not in registry.FALLBACK_MODEL_TYPES
        assert model_type not in registry.OTHER_DECODERS


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_refuses_them_by_name(name):
    with pytest.raises(pagedkv.UnsupportedModel, match=f"'{name}' is not sharded"):
        pagedkv.tensor_parallel(tiny(name))


@pytest.mark.parametrize("name, fields, words", [
    ("olmo2", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("olmo2", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)), "rope type 'dynamic'"),
])
def test_what_the_olmo2_decoder_does_not_run_is_refused(name, fields, words):
    model = tiny(name, **fields)
    reason = pagedkv.unsupported_reason(model)
    assert reason is not None and words in reason, reason
    with pytest.raises(pagedkv.UnsupportedModel, match=type(model).__name__):
        pagedkv.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


def test_an_adapter_on_olmo2_s_q_norm_is_refused():
    model = tiny("olmo2")
    attn = model.model.layers[1].self_attn
    attn.q_norm = torch.nn.Sequential(attn.q_norm)
    reason = pagedkv.unsupported_reason(model)
    assert reason is not None and "model.layers.1.self_attn.q_norm is a Sequential" in reason, reason


def test_weights_are_hf_s_own_tensors():
    """In-place writes to HF's parameters (optimizer steps) are seen without taking them again."""
    model = tiny("olmo2")
    ids, mask = tp_worker.left_padded([5, 19], 256, "cpu", seed=1)
    pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_norm.weight.mul_(-1.5)
        model.model.layers[1].self_attn.k_proj.weight.mul_(2.0)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY),
                       model.generate(ids, attention_mask=mask, **GREEDY))


def test_granite_s_residual_rounds_as_hf_s_in_bf16():
    """The sublayer output times residual_multiplier is rounded to bf16 before the add, as HF's
    ``residual + hidden * m``: the decoder's scale-in-place then fused add gives its bits."""
    torch.manual_seed(0)
    hidden, residual = torch.randn(2, 7, 256, dtype=torch.bfloat16).unbind(0)
    weight = torch.randn(256, dtype=torch.bfloat16)
    expected = residual + hidden * 0.22
    ours, res = hidden.clone(), residual.clone()
    ours.mul_(0.22)
    pagedkv.ops.fused_add_rms_norm(ours, res, weight, 1e-6)
    assert torch.equal(res, expected)
    assert not torch.equal((residual.float() + hidden.float() * 0.22).bfloat16(), expected)  # rounding shows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_olmo2_s_norm_and_rotation_are_hf_s_bits(dtype):
    """OLMo-2's RMSNorm (weight times the fp32 value) and its fp32 rotation, against HF's own
    modules, bit for bit; Llama's rounding (what the fused ops do) differs in bf16."""
    from transformers.models.olmo2 import modeling_olmo2 as hf
    torch.manual_seed(0)
    x = torch.randn(9, 4 * 64, dtype=dtype)
    norm = hf.Olmo2RMSNorm(4 * 64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(4 * 64))
        assert torch.equal(olmo2.rms_norm_fp32_weight(x, norm.weight, 1e-6), norm(x))
        if dtype == torch.bfloat16:
            assert not torch.equal(pagedkv.ops.rms_norm(x, norm.weight, 1e-6), norm(x))
    model = tiny("olmo2")
    positions = torch.tensor([0, 3, 7, 100, 5, 511, 2, 9, 40])
    cos_sin = prepared_cos_sin(model)
    cos, sin = model.model.rotary_emb(x, positions[None])  # [1, T, Dh] fp32
    q = x.view(9, 4, 64)
    expected, _ = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    got = olmo2.rotate_fp32(q, cos_sin[0], positions.to(torch.int32))
    assert torch.equal(got, expected[0].transpose(0, 1))


def prepared_cos_sin(model) -> torch.Tensor:
    pagedkv.generate(model, torch.tensor([[3, 4]]), max_new_tokens=1)
    return prepared(model).cos_sin  # [1, P, Dh]: OLMo-2's one table
