"""Int4 weight-only checkpoints (AWQ, GPTQ, compressed-tensors W4A16) read into one canonical form.

Every format stores 4-bit integers q, a scale and a zero point per group of input columns, and
dequantizes ``w = (q - zero) * scale``; they differ only in how the bits are laid out:

    AWQ (GEMM)  qweight [in, out/8] int32, 8 output columns a word in AWQ's order (below)
                qzeros  [in/g, out/8] int32, same order; scales [in/g, out] float16
    GPTQ        qweight [in/8, out] int32, 8 input rows a word, row 8r+e in bits 4e..4e+3
                qzeros  [in/g, out/8] int32, output column 8c+e in bits 4e..4e+3, stored as
                zero - 1 in the historical format (checkpoint_format "gptq"; "gptq_v2" stores
                the zero); scales [in/g, out]; g_idx [in]: the group of each input row
                (desc_act / act order: groups are not runs of consecutive rows)
    compressed-tensors "pack-quantized", symmetric: weight_packed [out, in/8] int32, 8 input
                columns a word, column 8w+e in bits 4e..4e+3, stored as q + 8; weight_scale
                [out, in/g]; no zero point (dequantized as (stored - 8) * scale)

The canonical form (Int4Weight) is output-major, one row per output column as a linear layer's
weight: q [out, in] uint8, scales and zeros [out, in/g]. A desc_act layer's input columns are
sorted by group so that every group is g consecutive columns again; `perm` records the sort.
torchao's tinygemm checkpoints (quant/torchao_int4.py) have float zeros added after scaling:
``w = (q - 8) * scale + zero``, zeros in the scales' dtype.
"""

from __future__ import annotations

import dataclasses

import torch

# AWQ packs output columns 8c + AWQ_ORDER[e] of word c into bits 4e..4e+3 (AutoAWQ's
# WQLinear_GEMM.pack, the order its fast dequantization wants).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = tuple(range(0, 32, 4))


@dataclasses.dataclass(slots=True)
class Int4Weight:
    """One linear layer's int4 weight: W[:, perm[c]] = (q[:, c] - zeros[:, c // g]) * scales[:, c // g]
    (perm None: the identity); float zeros: (q[:, c] - 8) * scales[:, c // g] + zeros[:, c // g]."""

    q: torch.Tensor  # [out, in] uint8, 0..15
    scales: torch.Tensor  # [out, in / g], the checkpoint's float dtype
    # [out, in / g] uint8, 0..16 (GPTQ's historical offset can make 16); or the scales' dtype
    zeros: torch.Tensor
    group_size: int  # g
    perm: torch.Tensor | None  # [in] int64: canonical column c multiplies input column perm[c]


def dequantize(w: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] weight in the layer's own input order, computed in fp32 (exact) then cast."""
    out_features, in_features = w.q.shape
    groups = w.q.float().view(out_features, -1, w.group_size)  # [out, in/g, g]
    scales, zeros = w.scales.float().unsqueeze(-1), w.zeros.float().unsqueeze(-1)
    sorted_w = (groups - 8) * scales + zeros if has_float_zeros(w) else (groups - zeros) * scales
    sorted_w = sorted_w.view(out_features, in_features)
    if w.perm is None:
        return sorted_w.to(dtype)
    weight = torch.empty_like(sorted_w)
    weight[:, w.perm] = sorted_w
    return weight.to(dtype)


def has_float_zeros(w: Int4Weight) -> bool:
    """Whether w's zeros are added after scaling (torchao's form) rather than zero points."""
    return w.zeros.is_floating_point()


def _unpack(words: torch.Tensor) -> torch.Tensor:
    """[..., n] int32 -> [..., n, 8] uint8: nibble e of each word (bits 4e..4e+3)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _group_size(group_size: int, in_features: int) -> int:
    """The checkpoint's group size (-1: one group over all input columns), checked."""
    g = in_features if group_size == -1 else group_size
    if g <= 0 or in_features % g != 0:
        raise ValueError(f"group_size {group_size} must be -1 or a positive divisor of in_features {in_features}")
    return g


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be {list(shape)} of {allowed}, got {list(t.shape)} {t.dtype}")


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    """An AWQ (GEMM version, 4 bits) layer's tensors as stored -> Int4Weight.

    qweight [in, out/8] int32; qzeros [in/g, out/8] int32; scales [in/g, out] float16/bfloat16.
    """
    in_features, out_features = qweight.shape[0], scales.shape[-1]
    g = _group_size(group_size, in_features)
    _check("qweight", qweight, (in_features, out_features // 8), (torch.int32,))
    _check("qzeros", qzeros, (in_features // g, out_features // 8), (torch.int32,))
    _check("scales", scales, (in_features // g, out_features), (torch.float16, torch.bfloat16))
    if out_features % 8:
        raise ValueError(f"AWQ out_features {out_features} must be a multiple of 8")
    order = list(AWQ_ORDER)

    def columns(words: torch.Tensor) -> torch.Tensor:  # [r, out/8] -> [r, out] in column order
        nibbles = _unpack(words)  # [r, out/8, 8]: nibble e is column 8c + AWQ_ORDER[e]
        ordered = torch.empty_like(nibbles)
        ordered[..., order] = nibbles
        return ordered.flatten(-2)

    return Int4Weight(q=columns(qweight).t().contiguous(), scales=scales.t().contiguous(),
                      zeros=columns(qzeros).t().contiguous(), group_size=g, perm=None)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              group_size: int, zero_offset: bool) -> Int4Weight:
    """A GPTQ (4 bits) layer's tensors as stored -> Int4Weight.

    qweight [in/8, out] int32; qzeros [in/g, out/8] int32; scales [in/g, out] float16/bfloat16;
    g_idx [in] int32/int64 or None (groups of consecutive rows). zero_offset: the checkpoint
    stores zero - 1 (checkpoint_format "gptq", AutoGPTQ's; False for "gptq_v2"). A desc_act
    layer (g_idx not the consecutive groups) gets its columns sorted by group and a `perm`.
    """
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    g = _group_size(group_size, in_features)
    groups = in_features // g
    _check("qweight", qweight, (in_features // 8, out_features), (torch.int32,))
    _check("qzeros", qzeros, (groups, out_features // 8), (torch.int32,))
    _check("scales", scales, (groups, out_features), (torch.float16, torch.bfloat16))
    if out_features % 8:
        raise ValueError(f"GPTQ out_features {out_features} must be a multiple of 8")
    q = _unpack(qweight).transpose(1, 2).reshape(in_features, out_features)  # [in, out]
    zeros = _unpack(qzeros).flatten(-2)  # [in/g, out]
    if zero_offset:
        zeros = zeros + 1  # AutoGPTQ's zeros + 1, unmasked: a stored 15 is a zero of 16
    perm = _act_order(g_idx, in_features, g)
    if perm is not None:
        q = q[perm]
    return Int4Weight(q=q.t().contiguous(), scales=scales.t().contiguous(), zeros=zeros.t().contiguous(),
                      group_size=g, perm=perm)


def _act_order(g_idx: torch.Tensor | None, in_features: int, g: int) -> torch.Tensor | None:
    """The input columns sorted by group (None if they already are), checked to give every group
    exactly g columns, as GPTQ's act order does."""
    if g_idx is None:
        return None
    _check("g_idx", g_idx, (in_features,), (torch.int32, torch.int64))
    consecutive = torch.arange(in_features, device=g_idx.device) // g
    if torch.equal(g_idx.long(), consecutive):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], consecutive):
        raise ValueError(f"g_idx must give each of the {in_features // g} groups exactly {g} input rows")
    return perm


def from_compressed_tensors_int4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                                 weight_shape: torch.Tensor, group_size: int) -> Int4Weight:
    """A compressed-tensors "pack-quantized" 4-bit symmetric layer's tensors as stored -> Int4Weight.

    weight_packed [out, in/8] int32: column 8w + e of a row in bits 4e..4e+3 of word w, each value
    stored as q + 8 (q in -8..7); weight_scale [out, in/g] float16/bfloat16 (strategy
    "group"; [out, 1] for "channel", group_size -1); weight_shape [2] int: [out, in]. The
    format dequantizes w = q * scale, which is (stored - 8) * scale: a zero of 8 in every group.
    """
    if weight_shape.numel() != 2:
        raise ValueError(f"weight_shape must hold [out, in], got {weight_shape.tolist()}")
    out_features, in_features = (int(d) for d in weight_shape.tolist())
    if in_features % 8:
        raise ValueError(f"in_features {in_features} must be a multiple of 8 (no padded words)")
    g = _group_size(group_size, in_features)
    _check("weight_packed", weight_packed, (out_features, in_features // 8), (torch.int32,))
    _check("weight_scale", weight_scale, (out_features, in_features // g), (torch.float16, torch.bfloat16))
    q = _unpack(weight_packed).flatten(-2)  # [out, in]: word w's nibble e is column 8w + e
    zeros = torch.full((out_features, in_features // g), 8, dtype=torch.uint8, device=q.device)
    return Int4Weight(q=q.contiguous(), scales=weight_scale.contiguous(), zeros=zeros, group_size=g, perm=None)
