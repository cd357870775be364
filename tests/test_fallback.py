"""The fallback path (models/fallback.py): decoder-only types pagedkv has no native decoder for,
run by their own HF modules over pagedkv's cache, give HF's greedy tokens through generate and
LLM (chunked prefill included) and hold no block after; every causal-LM type of the installed
transformers is native, fallback, or refused with a reason; what the attention function cannot
compute is refused; an error mid-forward leaves the model's attention implementation and the
cache as they were."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import pagedkv
import tp_worker
from conftest import DEVICES
from pagedkv.models import fallback, registry
from pagedkv.runtime.runner import cuda_graphs_wanted
from models import widen
from test_engine import assert_llm_gives_hf_greedy_tokens, assert_nothing_held, random_prompts

SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)  # head_dim 64
GQA = dict(num_key_value_heads=1)  # for the configs that have the field (others keep it as junk)
# model_type -> config fields beyond SMALL; each on registry.FALLBACK_MODEL_TYPES.
CASES = {
    "apertus": GQA, "arcee": GQA, "codegen": dict(rotary_dim=32),
    "exaone4": GQA, "glm": GQA, "gpt_bigcode": {},
    "gpt_neox": {}, "gptj": dict(rotary_dim=32), "granitemoe": GQA,
    "hunyuan_v1_dense": dict(GQA, head_dim=64), "jais2": GQA,
    "nemotron": dict(GQA, head_dim=64), "olmo": GQA,
    "opt": {}, "persimmon": {}, "phi": {}, "smollm3": GQA, "stablelm": GQA,
    "starcoder2": GQA,
    # mixtures of experts at a few experts each (top-k, shared experts, leading dense layers as
    # their real configs have them)
    "afmoe": dict(GQA, head_dim=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                  num_shared_experts=1, num_dense_layers=1),
    "cohere2_moe": dict(GQA, head_dim=64, num_experts=4, num_experts_per_tok=2, num_shared_experts=1),
    "ernie4_5_moe": dict(GQA, moe_num_experts=8, moe_k=2, moe_intermediate_size=64, moe_num_shared_experts=1),
    "exaone_moe": dict(GQA, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                       num_shared_experts=1, first_k_dense_replace=1),
    "flex_olmo": dict(GQA, num_experts=7, num_experts_per_tok=5),
    "glm4_moe": dict(GQA, head_dim=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                     first_k_dense_replace=1),
    "granitemoeshared": dict(GQA, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=128),
    "hunyuan_v1_moe": dict(GQA, head_dim=64, num_experts=4, moe_topk=2),
    "mellum": dict(GQA, head_dim=64, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    "minimax_m2": dict(GQA, head_dim=64, num_local_experts=8, num_experts_per_tok=2),
    "phimoe": dict(GQA, num_local_experts=4, num_experts_per_tok=2),
    "solar_open": dict(GQA, head_dim=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    # dense (cohere2, vaultgemma: sliding and full layers; vaultgemma, nanochat: softcaps)
    "biogpt": {}, "bitnet": GQA, "cohere2": dict(GQA, head_dim=64), "exaone": GQA,
    "glm4": dict(GQA, head_dim=64), "nanochat": GQA, "vaultgemma": dict(GQA, head_dim=64),
    # attention sinks, biased experts with a clamped GLU, sliding and full layers, yarn rope
    "gpt_oss": dict(GQA, head_dim=64, num_local_experts=4, num_experts_per_tok=2),
}
# Window types get one shorter than the test's sequences (19 + 16 tokens), with sliding and full
# layers (the kernels compute windows on the CPU and CUDA alike).
WINDOWS = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
WINDOWED = ("afmoe", "cohere2", "cohere2_moe", "exaone_moe", "vaultgemma", "gpt_oss")
# Fields whose defaults are None in these types' configs, which their modules cannot build from.
DEFAULTS_MISSING = {"hunyuan_v1_dense": dict(head_dim=128), "hunyuan_v1_moe": dict(head_dim=128),
                    "ministral": dict(head_dim=128),
                    "nemotron": dict(head_dim=128, num_key_value_heads=8)}
GREEDY = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)


def tiny(model_type: str, device: str = "cpu", seed: int = 0, **fields):
    """A tiny random fp32 model; weights widened (tests/models.py) and norm weights jittered, so
    logits are far from ties and tokens vary (Gemma's zero-initialised norms give one token)."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"model_type {model_type!r} is not in transformers here")
    torch.manual_seed(seed)
    window = WINDOWS if model_type in WINDOWED else {}
    config = AutoConfig.for_model(model_type, **{**SMALL, **CASES.get(model_type, {}), **window, **fields})
    # softcapped scores: HF's eager attention computes them, its SDPA (5.17's default) drops them
    eager = dict(attn_implementation="eager") if getattr(config, "attn_logit_softcapping", None) else {}
    model = AutoModelForCausalLM.from_config(config, **eager)
    return widen(model, norms=True).to(device).eval()


def assert_varied(tokens: torch.Tensor) -> None:
    """HF's tokens are not one repeated token: a test over them could not tell models apart."""
    assert len(set(tokens.flatten().tolist())) >= 4, tokens


def assert_refused_outside_the_attention_interface(model) -> None:
    """A type whose installed modeling code has no attention dispatch is refused before anything
    runs, naming the transformers version; its model and cache are left as they were."""
    reason = pagedkv.unsupported_reason(model)
    assert reason and "not through HF's attention interface" in reason and "transformers" in reason, reason
    ids = torch.tensor([[3, 4, 5]], device=model.device)
    with pytest.raises(pagedkv.UnsupportedModel, match="attention interface"):
        pagedkv.generate(model, ids, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(pagedkv.UnsupportedModel, match="attention interface"):
        pagedkv.LLM(model)


def test_allowlist_is_what_is_tested():
    assert sorted(CASES) == sorted(registry.FALLBACK_MODEL_TYPES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", list(CASES))
def test_generate_gives_hf_greedy_tokens(model_type, device):
    model = tiny(model_type, device)
    if not fallback._dispatches_attention(type(model).__module__):  # GPT-J, CodeGen in 5.17
        assert_refused_outside_the_attention_interface(model)
        return
    assert pagedkv.support_path(model) == "fallback", pagedkv.unsupported_reason(model)
    own = model.config._attn_implementation
    ids, mask = tp_worker.left_padded([5, 19], 256, device, seed=1)
    expected = model.generate(ids, attention_mask=mask, **GREEDY)  # [2, 19 + 16]
    assert_varied(expected[:, ids.shape[1]:])
    got = pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)  # CUDA graphs on CUDA
    assert torch.equal(got, expected)
    assert model.config._attn_implementation == own
    assert_nothing_held(model)


@pytest.mark.parametrize("model_type", list(CASES))
def test_llm_gives_hf_greedy_tokens(model_type):
    """Prompts chunked by an 8-token step budget: prefill chunks over cached context, decode rows
    in the same steps."""
    model = tiny(model_type)
    if not fallback._dispatches_attention(type(model).__module__):
        assert_refused_outside_the_attention_interface(model)
        return
    prompts = random_prompts([5, 19])
    llm = pagedkv.LLM(model, max_num_seqs=2, max_num_batched_tokens=8)
    assert_llm_gives_hf_greedy_tokens(llm, model, prompts, GREEDY)


def test_use_cuda_graphs_for_a_fallback_model():
    """On by default and allowed with True (tests/test_fallback_graphs.py captures them) until a
    decode step of the model failed to capture: then None runs eagerly and True raises, naming
    the capture's error (it used to raise for every fallback model)."""
    weights = fallback.fallback_weights(tiny("gpt_neox"))
    prepared = types.SimpleNamespace(device=torch.device("cuda", 0), weights=weights)
    assert cuda_graphs_wanted(None, prepared, "pagedkv.generate") is True
    assert cuda_graphs_wanted(True, prepared, "pagedkv.generate") is True
    assert cuda_graphs_wanted(False, prepared, "pagedkv.generate") is False
    weights.capture_error = "RuntimeError: operation not permitted when stream is capturing"
    with pytest.raises(ValueError, match=r"pagedkv.generate: use_cuda_graphs=True, but the decode step of "
                                         r"GPTNeoXForCausalLM .* cannot be captured as a CUDA graph: "
                                         r"RuntimeError: operation not permitted"):
        cuda_graphs_wanted(True, prepared, "pagedkv.generate")
    assert cuda_graphs_wanted(None, prepared, "pagedkv.generate") is False
    assert cuda_graphs_wanted(False, prepared, "pagedkv.generate") is False


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_every_causal_lm_type_is_native_fallback_or_refused(model_type):
    """Each type with its default config, on meta (no weights, so nothing runs): a native or
    fallback type is refused only for what its config holds or for being on meta; any other
    type is refused by name."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
                model_type, num_hidden_layers=1, **DEFAULTS_MISSING.get(model_type, {})))
    except Exception as e:  # a default config that cannot build: must not be a type pagedkv runs
        assert model_type not in registry.FALLBACK_MODEL_TYPES + registry.NATIVE_MODEL_TYPES, e
        return
    path = model.config.model_type  # may differ from the mapping's key
    reason = pagedkv.unsupported_reason(model)
    assert reason, path
    assert pagedkv.support_path(model) is None
    if path in registry.FALLBACK_MODEL_TYPES + registry.NATIVE_MODEL_TYPES:
        assert any(w in reason for w in ("meta device", "softcapping", "head_dim", "attention interface")), reason
    else:
        assert f"model_type {path!r} is not supported" in reason, reason


def test_support_path_names_the_path():
    assert pagedkv.support_path(tiny("gpt_neox")) == "fallback"
    assert pagedkv.support_path(tiny("gpt_neox", add_cross_attention=True)) is None
    from models import tiny_model
    assert pagedkv.support_path(tiny_model("llama")) == "native"


@pytest.mark.parametrize("model_type, fields, words", [
    ("falcon", dict(alibi=True), "model_type 'falcon' is not supported"),  # its own attention code
    ("bloom", {}, "model_type 'bloom' is not supported"),  # alibi, outside HF's attention interface
    ("gpt_neox", dict(add_cross_attention=True), "cross-attention"),
    ("olmo", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "rope type 'dynamic'"),
])
def test_what_the_attention_cannot_compute_is_refused(model_type, fields, words):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"model_type {model_type!r} is not in transformers here")
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **fields})
    model = AutoModelForCausalLM.from_config(config).eval()
    reason = pagedkv.unsupported_reason(model)
    assert reason is not None and words in reason, reason
    with pytest.raises(pagedkv.UnsupportedModel, match=model_type):
        pagedkv.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2)


def test_tensor_parallel_refuses_fallback_models():
    with pytest.raises(pagedkv.UnsupportedModel, match="'gpt_neox' runs by its own HF modules"):
        pagedkv.tensor_parallel(tiny("gpt_neox"))


def test_layers_outside_the_attention_interface_are_caught(monkeypatch):
    """A type whose attention does not go through HF's interface never writes the cache: its
    forward is refused, not run wrong (Bloom, put on the allowlist here)."""
    monkeypatch.setattr(registry, "FALLBACK_MODEL_TYPES", registry.FALLBACK_MODEL_TYPES + ("bloom",))
    monkeypatch.setattr(fallback, "_dispatches_attention", lambda module_name: True)  # passes the up-front check
    model = tiny("bloom")
    with pytest.raises(RuntimeError, match="0 of 2 layers ran pagedkv's attention"):
        pagedkv.generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=2, pad_token_id=0)
    assert_nothing_held(model)


def test_a_module_without_attention_dispatch_is_refused_before_running(monkeypatch):
    """GPT-J and CodeGen in transformers 5.17 compute attention in their own `_attn`: refused up
    front (the layer count above would only catch it mid-call)."""
    model = tiny("gpt_neox")
    assert fallback._dispatches_attention(type(model).__module__)
    monkeypatch.setattr(fallback, "_dispatches_attention", lambda module_name: module_name != type(model).__module__)
    assert_refused_outside_the_attention_interface(model)
    assert "GPTNeoXForCausalLM's attention" in pagedkv.unsupported_reason(model)


def test_an_error_mid_forward_restores_the_model(monkeypatch):
    model = tiny("gpt_neox")
    own = model.config._attn_implementation
    ids, mask = tp_worker.left_padded([5, 19], 256, "cpu", seed=1)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second layer of the prefill
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = fallback.paged_attention
    monkeypatch.setattr(fallback, "paged_attention", failing)
    with pytest.raises(KeyboardInterrupt):
        pagedkv.generate(model, ids, attention_mask=mask, **GREEDY)
    monkeypatch.setattr(fallback, "paged_attention", real)
    assert model.config._attn_implementation == own
    assert fallback._CALL.get() is None
    assert_nothing_held(model)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY),
                       model.generate(ids, attention_mask=mask, **GREEDY))


@pytest.mark.parametrize("device", DEVICES)
def test_gpt_oss_sinks_that_decide_tokens(device):
    """GPT-OSS with sinks large enough to change its greedy tokens (checked: HF's tokens with the
    sinks zeroed differ) gives HF's tokens, decode and prefill."""
    model = tiny("gpt_oss", device)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2.0)
    ids, mask = tp_worker.left_padded([5, 19], 256, device, seed=2)
    expected = model.generate(ids, attention_mask=mask, **GREEDY)
    assert torch.equal(pagedkv.generate(model, ids, attention_mask=mask, **GREEDY), expected)
    with torch.no_grad():
        saved = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # weight exp(-1e4): as if there were none
    try:
        assert not torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), expected)
    finally:
        with torch.no_grad():
            for layer, s in zip(model.model.layers, saved):
                layer.self_attn.sinks.copy_(s)
    assert_nothing_held(model)
