"""rope_and_write_kv against HF's apply_rotary_pos_emb (and Qwen3's q_norm/k_norm) in plain
PyTorch, and build_cos_sin_cache against HF's rotary embedding modules."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from conftest import DEVICES
from pagedkv import ops
from pagedkv.layers.rotary import build_cos_sin_cache
from tolerance import assert_close_to_baseline

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 72]  # 72: the half (36) is not a multiple of 8, so the scalar path runs
HEADS = [(4, 4), (8, 2), (12, 1)]  # (q heads, kv heads): GQA ratios 1, 4, 12
BLOCK_SIZES = [1, 16]
NUM_TOKENS = [1, 7]
MAX_POSITION = 1024
EPS = 1e-6


@functools.cache
def cos_sin_cache(rot_dim: int, device, theta: float = 1e6) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.arange(MAX_POSITION, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def reference(q, k, positions, cache, dtype, q_w=None, k_w=None):
    """HF: optional per-head RMSNorm, then apply_rotary_pos_emb on the first rot_dim dims with
    cos/sin cast to the dtype (rotate-half convention: each half of the cache repeated)."""
    if q_w is not None:
        q, k = rms_norm(q, q_w), rms_norm(k, k_w)
    half = cache.shape[1] // 2
    cos = cache[positions.long(), :half].repeat(1, 2).to(dtype)
    sin = cache[positions.long(), half:].repeat(1, 2).to(dtype)
    rot = 2 * half
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin, unsqueeze_dim=1)
    return torch.cat([q_rot, q[..., rot:]], -1), torch.cat([k_rot, k[..., rot:]], -1)


def rms_norm(x, weight):
    if x.dtype == torch.float64:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
    norm = Qwen3RMSNorm(x.shape[-1], eps=EPS).to(device=x.device, dtype=x.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


def make_inputs(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device):
    """q, k, v as views of one fused QKV output (strided rows), random slots with one padding."""
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width + 8, dtype=dtype, device=device)  # +8: a row stride != width
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k_end = (num_q_heads + num_kv_heads) * head_dim
    k = qkv[:, num_q_heads * head_dim : k_end].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, k_end:width].view(num_tokens, num_kv_heads, head_dim)
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens].to(torch.int32)
    slots[num_tokens // 2] = -1  # a padding row
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), dtype=torch.int32, device=device)
    return q, k, v, positions, k_cache, v_cache, slots


def assert_bitwise(out, expected, name):
    if not torch.equal(out, expected):
        diff = (out.double() - expected.double()).abs()
        raise AssertionError(f"{name}: {int((diff != 0).sum())} of {diff.numel()} elements differ "
                             f"from HF's (max {diff.max().item():.3g})")


def check_cache(k_cache, v_cache, slots, k_expected, v_expected):
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    written = slots >= 0
    idx = slots[written].long()
    assert_bitwise(flat_k[idx], k_expected[written], "k_cache")
    assert_bitwise(flat_v[idx], v_expected[written], "v_cache")
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=flat_k.device)
    untouched[idx] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all(), \
        "a slot not in slot_mapping was written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rope_and_write_kv_matches_hf_bitwise(device, dtype, head_dim, heads, block_size, num_tokens):
    q, k, v, positions, k_cache, v_cache, slots = make_inputs(num_tokens, *heads, head_dim, block_size, dtype, device)
    cache = cos_sin_cache(head_dim, device)
    q_ref, k_ref = reference(q.clone(), k.clone(), positions, cache, dtype)
    v_ref = v.clone()

    ops.rope_and_write_kv(q, k, v, positions, cache, k_cache, v_cache, slots)

    # Same rounding steps as HF in the same dtype: equal to the last bit.
    assert_bitwise(q, q_ref, "q")
    assert_bitwise(k, k_ref, "k")
    check_cache(k_cache, v_cache, slots, k_ref, v_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rot_dim", [None, 32])  # None: full rotary; 32: partial
def test_qk_norm_before_rope(device, dtype, head_dim, rot_dim):
    """Qwen3: RMSNorm of each q and k head (HF's rounding), then RoPE; k written post-norm."""
    q, k, v, positions, k_cache, v_cache, slots = make_inputs(5, 8, 2, head_dim, 16, dtype, device)
    q.mul_(3).add_(0.5)
    cache = cos_sin_cache(rot_dim or head_dim, device)
    q_w = torch.rand(head_dim, dtype=dtype, device=device) + 0.5
    k_w = torch.rand(head_dim, dtype=dtype, device=device) + 0.5
    q_base, k_base = reference(q.clone(), k.clone(), positions, cache, dtype, q_w, k_w)
    q_exact, k_exact = reference(q.double(), k.double(), positions, cache.double(), torch.float64,
                                 q_w.double(), k_w.double())
    v_ref = v.clone()

    ops.rope_and_write_kv(q, k, v, positions, cache, k_cache, v_cache, slots, q_w, k_w, EPS)

    assert_close_to_baseline(q, q_base, q_exact, name="q")
    assert_close_to_baseline(k, k_base, k_exact, name="k")
    check_cache(k_cache, v_cache, slots, k, v_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_partial_rotary_leaves_the_rest(device):
    q, k, v, positions, k_cache, v_cache, slots = make_inputs(3, 4, 2, 128, 16, torch.bfloat16, device)
    cache = cos_sin_cache(64, device)
    q_ref, k_ref = reference(q.clone(), k.clone(), positions, cache, torch.bfloat16)
    q_tail = q[..., 64:].clone()
    ops.rope_and_write_kv(q, k, v, positions, cache, k_cache, v_cache, slots)
    assert_bitwise(q, q_ref, "q")
    assert_bitwise(k, k_ref, "k")
    assert torch.equal(q[..., 64:], q_tail)


ROPE_CONFIGS = {
    "qwen3_default": Qwen3Config(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "llama3": LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192}),
    "yarn": LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 2048}),
    "linear": LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                          rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ROPE_CONFIGS))
def test_cos_sin_cache_is_hf_bitwise(device, name):
    config = ROPE_CONFIGS[name]
    cache = build_cos_sin_cache(config, 3000, device)
    hf = LlamaRotaryEmbedding(config).to(device)  # the same math for all Llama-family models
    positions = torch.tensor([[0, 1, 17, 1000, 2999]], device=device)
    cos, sin = hf(torch.empty(1, dtype=torch.float32, device=device), positions)
    half = cache.shape[1] // 2
    assert cache.dtype == torch.float32 and cache.is_contiguous()
    assert_bitwise(cache[positions[0], :half].repeat(1, 2), cos[0], "cos")
    assert_bitwise(cache[positions[0], half:].repeat(1, 2), sin[0], "sin")


def test_dynamic_rope_is_refused():
    config = LlamaConfig(hidden_size=256, num_attention_heads=4,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        build_cos_sin_cache(config, 16, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q, k, v, positions, k_cache, v_cache, slots = make_inputs(4, 4, 2, 64, 16, torch.float32, device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    w = torch.rand(64, device=device) + 0.5
    cache = cos_sin_cache(64, device)
    for norms in [(None, None), (w, w)]:
        torch.library.opcheck(torch.ops.pagedkv.rope_and_write_kv.default,
                              (q, k, v, positions, cache, k_cache, v_cache, slots, *norms, EPS))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_name_the_argument(device):
    q, k, v, positions, k_cache, v_cache, slots = make_inputs(4, 4, 2, 64, 16, torch.float32, device)
    cache = cos_sin_cache(64, device)

    def call(**kw):
        args = dict(q=q, k=k, v=v, positions=positions, cos_sin_cache=cache, k_cache=k_cache,
                    v_cache=v_cache, slot_mapping=slots)
        args.update(kw)
        ops.rope_and_write_kv(**args)

    with pytest.raises(RuntimeError, match=r"positions has dtype Long; allowed: torch.int32"):
        call(positions=positions.long())
    with pytest.raises(RuntimeError, match=r"k_cache must have shape \[num_blocks, block_size, num_kv_heads"):
        call(k_cache=k_cache[..., :32])
    with pytest.raises(RuntimeError, match=r"cos_sin_cache has dtype BFloat16; it must be Float"):
        call(cos_sin_cache=cache.bfloat16())
    with pytest.raises(RuntimeError, match=r"q has 4 heads and k has 3"):
        call(k=torch.randn(4, 3, 64, device=device), v=torch.randn(4, 3, 64, device=device))
    with pytest.raises(RuntimeError, match=r"v has dtype Half but q has Float"):
        call(v=v.half())
    with pytest.raises(RuntimeError, match=r"q_norm_weight must have shape \[head_dim\] = \[64\]"):
        call(q_norm_weight=torch.ones(32, device=device))
    with pytest.raises(RuntimeError, match=r"q must have its heads packed"):
        call(q=q.transpose(0, 1).contiguous().transpose(0, 1))
    if device == "cpu":  # the CPU op reads the metadata; the CUDA kernel skips bad rows instead
        with pytest.raises(RuntimeError, match=r"positions\[0\] = 1024 is outside"):
            call(positions=torch.full_like(positions, MAX_POSITION))
