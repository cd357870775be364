"""Rotary embeddings of interleaved pairs (Helium, ERNIE-4.5, Cohere) on the half-split kernel.

HF's interleaved rotation turns the pair of dimensions (2i, 2i + 1) of a head by angle i (its
rotate_half takes x[..., ::2] and x[..., 1::2]; cos/sin repeat each frequency twice, or take the
first half of a cat() table and repeat_interleave it); ops.rope_and_write_kv turns (i, i + Dh/2)
by angle i. The two agree on a head permuted by P = [0, 2, ..., Dh-2, 1, 3, ..., Dh-1]: the
half-split rotation of x[P] is the interleaved rotation of x, permuted by P. q.k is the same
sum over permuted q and k, and V is not touched; so the q and k rows of the projection (and
their biases, and a per-head q/k norm's weights) are permuted once at load, and the ordinary
decoder runs. The K written to the cache are permuted too (only pagedkv reads them).

The permuted rows are a copy (HF's own q_proj/k_proj keep their order and keep working), so
in-place writes to them would go unseen: runtime/model.py fingerprints these types with the
tensors' version counters, and takes the weights again after any write.
"""

from __future__ import annotations

import torch

# Llama's decoder (models/llama.py) on permuted q/k rows; Cohere has its own (models/cohere.py).
# Taken from the HF model on one device (the checkpoint readers, sharded or int4, do not permute).
INTERLEAVED_ROPE_MODEL_TYPES = ("helium", "ernie4_5")
# Every type whose q/k rows pagedkv permutes (a copy: in-place writes count as changes), Cohere's
# decoder's (models/cohere.py) too.
PERMUTED_ROWS_MODEL_TYPES = INTERLEAVED_ROPE_MODEL_TYPES + ("cohere",)


def halves_order(head_dim: int) -> torch.Tensor:
    """P [Dh] int64: the even dimensions, then the odd ones."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def permute_heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """t [H * Dh, ...] (a projection's rows, or its bias) -> a new tensor of its shape, each head's
    Dh rows in the order P."""
    order = halves_order(head_dim).to(t.device)
    heads = t.shape[0] // head_dim
    return t.detach().reshape(heads, head_dim, *t.shape[1:])[:, order].reshape(t.shape).contiguous()


def permute_last(t: torch.Tensor) -> torch.Tensor:
    """t [..., Dh] (a per-head norm's weight, e.g. Cohere's [H, Dh]) -> a new tensor, the last
    dimension in the order P."""
    return t.detach()[..., halves_order(t.shape[-1]).to(t.device)].contiguous()


def fuse_qkv_halves(attn, head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """attn's q, k, v Linears -> (qkv [(Hq + 2 Hkv) * Dh, D], bias or None): q and k rows permuted
    per head (a copy), v's rows as they are; v_proj is re-pointed to its slice (stored once)."""
    with_bias = attn.q_proj.bias is not None
    fused = torch.cat([permute_heads(attn.q_proj.weight, head_dim), permute_heads(attn.k_proj.weight, head_dim),
                       attn.v_proj.weight.detach()])
    bias = None
    if with_bias:
        bias = torch.cat([permute_heads(attn.q_proj.bias, head_dim), permute_heads(attn.k_proj.bias, head_dim),
                          attn.v_proj.bias.detach()])
    v_rows = attn.v_proj.weight.shape[0]
    attn.v_proj.weight.data = fused[fused.shape[0] - v_rows:]
    if with_bias:
        attn.v_proj.bias.data = bias[bias.shape[0] - v_rows:]
    return fused, bias


def interleaved_cos_sin(rotary: torch.nn.Module, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, Dh] fp32, cos | sin halves (ops.rope_and_write_kv's table) from an HF rotary
    module whose cos/sin repeat each frequency twice in a row (Cohere's repeat_interleave)."""
    on = next(rotary.buffers()).device
    positions = torch.arange(max_positions, device=on)[None]  # int64, as HF's position_ids
    cos, sin = rotary(torch.empty(1, dtype=torch.float32, device=on), positions)  # [1, P, Dh]
    return torch.cat([cos[0, :, ::2], sin[0, :, ::2]], dim=-1).to(device).contiguous()
