"""kv_cache_dtype="fp8" in pagedkv.generate() and pagedkv.LLM against HF's own generate whose
attention reads K/V quantized and dequantized as the fp8 cache stores them (tiny random models,
fp32 compute, CPU): the same greedy tokens. Also: the cache's bytes per token halve, the scales
come from kv_cache_scales / calibration / the checkpoint, and bad values are refused with
nothing held, the next call giving HF's tokens."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import pagedkv
from pagedkv.cache.kv_dtype import calibrate_kv_scales
from conftest import DEVICES
from models import tiny_model
from test_engine import assert_no_leaks, assert_nothing_held, random_prompts

FP8 = torch.float8_e4m3fn
GREEDY = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)


def flat(pairs) -> list[float]:
    return [x for pair in pairs for x in pair]


def fake_quantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What attention reads back from the fp8 cache: float(round_e4m3(clamp(x / s))) * s."""
    return ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale).to(x.dtype)


@contextlib.contextmanager
def hf_attention_reading_fp8(model, scales):
    """HF's sdpa attention with each layer's K/V (after RoPE) rounded as the fp8 cache rounds
    them; scales: per layer (k_scale, v_scale)."""
    own = model.config._attn_implementation
    # the model's own attention function (eager: its module's, e.g. Gemma-2's with the softcap)
    inner = (sys.modules[type(model).__module__].eager_attention_forward if own == "eager"
             else ALL_ATTENTION_FUNCTIONS[own])

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        return inner(module, query, fake_quantized(key, k_scale), fake_quantized(value, v_scale),
                     attention_mask, **kwargs)

    AttentionInterface.register("fp8_kv_reference", attention)
    AttentionMaskInterface.register("fp8_kv_reference", ALL_MASK_ATTENTION_FUNCTIONS[own])
    model.config._attn_implementation = "fp8_kv_reference"
    try:
        yield
    finally:
        model.config._attn_implementation = own


def hf_tokens(model, prompt, scales=None, max_new=12):
    ids = torch.tensor([prompt], device=model.device)
    with hf_attention_reading_fp8(model, scales) if scales else contextlib.nullcontext():
        out = model.generate(ids, **dict(GREEDY, max_new_tokens=max_new))
    return out[0, len(prompt):].tolist()


SCALES = [(0.004, 0.002), (0.003, 0.006)]  # K/V of these models reach ~0.5-2: e4m3's top end


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_generate_fp8_gives_the_fp8_reference_tokens(arch, device):
    """generate() and a patched model.generate (CUDA: with CUDA graphs, the scales read from
    device tensors at replay)."""
    model = tiny_model(arch, device=device)
    prompts = random_prompts([5, 23, 40], seed=3)
    differs = False
    for i, prompt in enumerate(prompts):
        want = hf_tokens(model, prompt, SCALES)
        differs |= want != hf_tokens(model, prompt)
        ids = torch.tensor([prompt], device=device)
        if i == 1:
            patched = pagedkv.patch(tiny_model(arch, device=device))
            got = patched.generate(ids, kv_cache_dtype="fp8", kv_cache_scales=SCALES, **GREEDY)
            assert pagedkv.kv_cache_of(patched).spec.dtype == FP8
        else:
            got = pagedkv.generate(model, ids, kv_cache_dtype="fp8", kv_cache_scales=SCALES, **GREEDY)
        assert got[0, len(prompt):].tolist() == want, f"prompt of {len(prompt)} tokens"
    assert differs, "the rounding must matter for this test to check it"
    cache = pagedkv.kv_cache_of(model)
    assert cache.spec.dtype == FP8 and cache.kv_scales.flatten().tolist() == pytest.approx(flat(SCALES))
    assert_nothing_held(model)
    # back to the default: a cache of the model's dtype again, HF's own tokens
    got = pagedkv.generate(model, torch.tensor([prompts[1]], device=device), **GREEDY)
    assert got[0, len(prompts[1]):].tolist() == hf_tokens(model, prompts[1])
    assert pagedkv.kv_cache_of(model).spec.dtype == torch.float32


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "olmo2"])
def test_native_gemma_and_olmo2_decoders(name):
    """Gemma-2/3 (windows, softcaps, q/k norms: models/gemma.py) and OLMo-2 (models/olmo2.py)
    write and read the fp8 cache through the same ops: the reference's tokens."""
    import test_gemma
    import test_granite_olmo2

    model = test_granite_olmo2.tiny(name) if name == "olmo2" else test_gemma.tiny(name)
    scales = [(0.01, 0.01)] * model.config.num_hidden_layers
    for prompt in random_prompts([5, 19], seed=8):
        got = pagedkv.generate(model, torch.tensor([prompt]), kv_cache_dtype="fp8",
                               kv_cache_scales=scales, **dict(GREEDY, max_new_tokens=16))
        assert got[0, len(prompt):].tolist() == hf_tokens(model, prompt, scales, max_new=16)
    assert_nothing_held(model)


@pytest.mark.parametrize("device", DEVICES)
def test_llm_fp8_gives_the_fp8_reference_tokens_and_twice_the_tokens(device):
    model = tiny_model("llama", device=device)
    prompts = random_prompts([3, 17, 33, 50], seed=4)
    llm = pagedkv.LLM(model, kv_cache_memory=1 << 20, kv_cache_dtype="fp8", kv_cache_scales=SCALES,
                      max_num_seqs=4, max_num_batched_tokens=16)  # chunked prefill over fp8 context
    plain = pagedkv.LLM(model, kv_cache_memory=1 << 20)
    assert llm.cache.capacity_tokens == 4 * plain.cache.capacity_tokens  # fp32 -> 1 byte
    assert llm.cache.spec.bytes_per_token * 4 == plain.cache.spec.bytes_per_token
    params = pagedkv.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_tokens(model, prompt, SCALES), f"prompt of {len(prompt)} tokens"
    assert_no_leaks(llm)
    assert "kv_scales=per layer" in repr(llm.cache)


def test_bf16_model_fp8_cache_halves_the_bytes():
    model = tiny_model("llama", dtype=torch.bfloat16)
    prompt = random_prompts([20], seed=5)[0]
    pagedkv.generate(model, torch.tensor([prompt]), **GREEDY)
    bf16 = pagedkv.kv_cache_of(model).spec.bytes_per_token
    pagedkv.generate(model, torch.tensor([prompt]), kv_cache_dtype="fp8", **GREEDY)
    assert pagedkv.kv_cache_of(model).spec.bytes_per_token * 2 == bf16


def test_scales_from_calibration_and_from_the_checkpoint():
    model = tiny_model("llama")
    prompt = random_prompts([30], seed=6)[0]
    ids = torch.tensor([prompt])
    pagedkv.generate(model, ids, kv_cache_dtype="fp8", kv_cache_scales="calibrate", **GREEDY)
    calibrated = calibrate_kv_scales(model, ids)
    assert pagedkv.kv_cache_of(model).kv_scales.flatten().tolist() == pytest.approx(flat(calibrated))
    # by hand: amax over the prompt of K after RoPE (HF's cache) and V, / 448
    past = model(ids, use_cache=True).past_key_values
    for layer, (k, v) in enumerate(calibrated):
        assert k == pytest.approx(float(past.layers[layer].keys.abs().max()) / 448)
        assert v == pytest.approx(float(past.layers[layer].values.abs().max()) / 448)
    # a checkpoint's k_scale / v_scale on the attention modules (compressed-tensors' names)
    for layer, attn in enumerate(m.self_attn for m in model.model.layers):
        attn.register_buffer("k_scale", torch.tensor(0.01 * (layer + 1)))
        attn.register_buffer("v_scale", torch.tensor(0.02 * (layer + 1)))
    try:
        out = pagedkv.generate(model, ids, kv_cache_dtype="fp8", **GREEDY)
        assert pagedkv.kv_cache_of(model).kv_scales.flatten().tolist() == pytest.approx([0.01, 0.02, 0.02, 0.04])
        assert out[0, len(prompt):].tolist() == hf_tokens(model, prompt, [(0.01, 0.02), (0.02, 0.04)])
    finally:
        for attn in (m.self_attn for m in model.model.layers):
            del attn.k_scale, attn.v_scale


BAD = [
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' is not supported; allowed: 'auto', 'fp8'"),
    (dict(kv_cache_dtype=torch.float16), "allowed: 'auto', 'fp8'"),
    (dict(kv_cache_dtype="fp8", kv_cache_scales=[(1.0, 1.0)]), "2 \\(k_scale, v_scale\\) pairs"),
    (dict(kv_cache_dtype="fp8", kv_cache_scales=[(1.0, 0.0), (1.0, 1.0)]), "positive finite"),
    (dict(kv_cache_dtype="fp8", kv_cache_scales="max"), "allowed: None, 'calibrate'"),
    (dict(kv_cache_scales=SCALES), "applies to kv_cache_dtype='fp8' only"),
    (dict(kv_cache_dtype="fp8", num_beams=2), "beam search"),
]


@pytest.mark.parametrize("kwargs, message", BAD)
def test_bad_values_are_refused_and_nothing_is_held(kwargs, message):
    model = tiny_model("llama")
    prompt = random_prompts([9], seed=7)[0]
    with pytest.raises(ValueError, match=message):
        pagedkv.generate(model, torch.tensor([prompt]), **dict(GREEDY, **kwargs))
    if all(k.startswith("kv_") for k in kwargs):  # the engine takes these two
        with pytest.raises(ValueError, match=message):
            pagedkv.LLM(model, num_kv_blocks=8, **kwargs)
    got = pagedkv.generate(model, torch.tensor([prompt]), **GREEDY)
    assert got[0, len(prompt):].tolist() == hf_tokens(model, prompt)
    assert_nothing_held(model)


def test_fallback_models_are_refused():
    """A model pagedkv runs on its own HF modules writes K/V with index_copy in its dtype."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=2)).eval()
    assert pagedkv.support_path(model) == "fallback"
    with pytest.raises(ValueError, match="fallback path"):
        pagedkv.generate(model, torch.tensor([[5, 6, 7]]), kv_cache_dtype="fp8", **GREEDY)
    with pytest.raises(ValueError, match="fallback path"):
        pagedkv.LLM(model, num_kv_blocks=8, kv_cache_dtype="fp8")


def test_llm_refuses_calibrate_naming_the_helper():
    """LLM has no prompts at construction: 'calibrate' names calibrate_kv_scales instead."""
    with pytest.raises(ValueError, match="kv_dtype.calibrate_kv_scales"):
        pagedkv.LLM(tiny_model("llama"), num_kv_blocks=8, kv_cache_dtype="fp8", kv_cache_scales="calibrate")
