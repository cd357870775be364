"""torchao int4 weight-only checkpoints (Int4WeightOnlyConfig version 2, int4_packing_format
"tile_packed_to_4d": tinygemm's layout, what `torch.ops.aten._weight_int4pack_mm` reads) read into
the canonical int4 form (int4.Int4Weight) with float zeros.

transformers saves a torchao tensor as its inner tensors beside safetensors metadata naming the
class (torchao's flatten_tensor_state_dict): a linear `{module}` stores

    {module}._weight_qdata           [N' / 8, K' / 128, 32, 4] int32: tinygemm's B operand
    {module}._weight_scale_and_zero  [K' / g, N', 2] bfloat16: (scale, zero) of each group

N' is N padded to a multiple of 8 and K' is K padded to a multiple of 1024 (torchao pads the
weight with zeros before quantizing). A weight is W = (q - 8) * scale + zero, q the stored
4-bit value (tinygemm dequantizes with one bf16 fused multiply-add).

The B layout (torch's matrix_to_m16n8k16_Bint4_layout, 8 inner k-tiles of 16): word j (0..3)
of lane t (0..31) in the tile [n-tile of 8 rows][k-tile of 128 columns] holds row t / 4 and
eight columns, as the m16n8k16 B fragments of k-tiles 2j and 2j + 1 want them. Its nibble e
(bits 4e..4e+3) is byte i = e % 4 of the lane's four, the even column of the byte for e < 4 and
the odd one for e >= 4; byte i starts at column 32 j + 16 (i / 2) + 8 (i % 2) + 2 (t % 4).
"""

from __future__ import annotations

import torch

from pagedkv.quant.int4 import Int4Weight

K_PAD = 1024  # torchao pads in_features to a multiple of this
N_PAD = 8  # and out_features to a multiple of this (its int4_tile_packed_ntile)
TILE_ROWS, TILE_COLS = 8, 128  # one [n-tile][outer k-tile] of qdata: 32 lanes x 4 words x 8 nibbles


def _tile_positions() -> torch.Tensor:
    """[32 * 4 * 8] int64: the position row * 128 + column within its 8 x 128 tile of each nibble
    of qdata's [32 lanes][4 words][8 nibbles] (the module docstring's layout); a permutation."""
    t = torch.arange(32).view(32, 1, 1)
    j = torch.arange(4).view(1, 4, 1)
    e = torch.arange(8).view(1, 1, 8)
    byte, odd = e % 4, e // 4
    column = 32 * j + 16 * (byte // 2) + 8 * (byte % 2) + 2 * (t % 4) + odd
    return ((t // 4) * TILE_COLS + column).flatten()


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def unpack_tile_packed(qdata: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """qdata [N' / 8, K' / 128, 32, 4] int32 -> q [out_features, in_features] uint8 (0..15), the
    padding dropped."""
    n_tiles, k_tiles = qdata.shape[0], qdata.shape[1]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qdata.device)
    nibbles = ((qdata.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # [NT, KT, 32, 4, 8]
    tiles = torch.empty((n_tiles, k_tiles, TILE_ROWS * TILE_COLS), dtype=torch.uint8, device=qdata.device)
    tiles[:, :, _tile_positions().to(qdata.device)] = nibbles.flatten(2)
    q = tiles.view(n_tiles, k_tiles, TILE_ROWS, TILE_COLS).permute(0, 2, 1, 3)
    return q.reshape(n_tiles * TILE_ROWS, k_tiles * TILE_COLS)[:out_features, :in_features].contiguous()


def pack_tile_packed(q: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_tile_packed for q [N, K] (0..15), zero-padded to N' and K' as torchao
    pads its weight (tools/quant_writers.py writes test checkpoints with it)."""
    n, k = q.shape
    padded = torch.zeros((_padded(n, N_PAD), _padded(k, K_PAD)), dtype=torch.int64, device=q.device)
    padded[:n, :k] = q.to(torch.int64)
    n_tiles, k_tiles = padded.shape[0] // TILE_ROWS, padded.shape[1] // TILE_COLS
    tiles = padded.view(n_tiles, TILE_ROWS, k_tiles, TILE_COLS).permute(0, 2, 1, 3).reshape(n_tiles, k_tiles, -1)
    nibbles = tiles[:, :, _tile_positions().to(q.device)].view(n_tiles, k_tiles, 32, 4, 8)
    words = (nibbles << torch.arange(0, 32, 4, device=q.device)).sum(-1)  # [NT, KT, 32, 4], 0 .. 2^32 - 1
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def from_torchao_tile_packed(qdata: torch.Tensor, scale_and_zero: torch.Tensor, out_features: int,
                             in_features: int, group_size: int) -> Int4Weight:
    """A torchao Int4TilePackedTo4dTensor's stored tensors (the module docstring) of a linear
    [out_features, in_features] -> Int4Weight with float zeros."""
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"group_size {group_size} must divide in_features {in_features} (pagedkv reads whole "
                         "groups; torchao's padding groups are dropped)")
    n_pad, k_pad = _padded(out_features, N_PAD), _padded(in_features, K_PAD)
    want = (n_pad // TILE_ROWS, k_pad // TILE_COLS, 32, 4)
    if tuple(qdata.shape) != want or qdata.dtype != torch.int32:
        raise ValueError(f"qdata must be {list(want)} torch.int32 for a [{out_features}, {in_features}] weight, "
                         f"got {list(qdata.shape)} {qdata.dtype}")
    want = (k_pad // group_size, n_pad, 2)
    if tuple(scale_and_zero.shape) != want or scale_and_zero.dtype != torch.bfloat16:
        raise ValueError(f"scale_and_zero must be {list(want)} torch.bfloat16 (group_size {group_size}), got "
                         f"{list(scale_and_zero.shape)} {scale_and_zero.dtype}")
    groups = in_features // group_size
    scales = scale_and_zero[:groups, :out_features, 0].t().contiguous()  # [N, K / g]
    zeros = scale_and_zero[:groups, :out_features, 1].t().contiguous()
    return Int4Weight(q=unpack_tile_packed(qdata, out_features, in_features), scales=scales, zeros=zeros,
                      group_size=group_size, perm=None)
