"""Writes into the paged KV cache: a step's rotated K/V into its slots, and block copy-on-write."""

from __future__ import annotations

import torch

from pagedkv.ops._common import _kv_scales, _ops


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotary embedding of q and k in place, then k and v written into their cache slots.

    q: [num_tokens, num_q_heads, head_dim], k, v: [num_tokens, num_kv_heads, head_dim] (heads
    packed, token stride free: views of one fused QKV output work), float32/float16/bfloat16.
    positions, slot_mapping: [num_tokens] int32; a negative slot writes nothing (padding), its
    q/k are still rotated. cos_sin_cache: [max_position, rot_dim] float32 from
    ``pagedkv.layers.rotary.build_cos_sin_cache`` (rot_dim <= head_dim; dims past rot_dim are not
    rotated). k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], slot
    s = block * block_size + offset. q_norm_weight / k_norm_weight: [head_dim], Qwen3's per-head
    RMSNorm applied before the rotation. Rounding as HF's ``apply_rotary_pos_emb`` in the dtype.
    An fp8 cache stores e4m3 of ``(x.float() / scale).clamp(-448, 448)``: see layers/attention.py.
    """
    k_scale, v_scale = _kv_scales(k_cache, v_cache, k_scale, v_scale)
    _ops.rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                           q_norm_weight, k_norm_weight, epsilon, k_scale, v_scale)


@torch.library.register_fake("pagedkv::rope_and_write_kv")
def _rope_and_write_kv_fake(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                            q_norm_weight, k_norm_weight, epsilon, k_scale=None, v_scale=None) -> None:
    return None


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy-on-write of whole cache blocks: ``cache[dst[i]] = cache[src[i]]`` in every layer.

    k_caches, v_caches: one [num_blocks, block_size, num_kv_heads, head_dim] tensor per layer, all
    of one shape/dtype/device; src, dst: [N] int32 or int64 block ids on that device, dst blocks
    distinct and not among src. One CUDA launch per 64 layers.
    """
    _ops.copy_blocks(k_caches, v_caches, src, dst)


@torch.library.register_fake("pagedkv::copy_blocks")
def _copy_blocks_fake(k_caches, v_caches, src, dst) -> None:
    return None
