"""A tiny reference quantizer that writes one linear layer's random fp weight in the exact on-disk
int4 formats (AWQ GEMM, GPTQ with/without its zero - 1 offset and act order; compressed-tensors'
pack-quantized writer is shared with the benchmarks: pagedkv.tools.quant_writers), and each
format's own dequantization formula, transcribed from the packages that define them (AutoAWQ's
WQLinear_GEMM.pack / dequantize_gemm, AutoGPTQ's QuantLinear.pack and its torch forward). Written
loop by loop as those packages do, independently of pagedkv.quant's vectorized reader."""

from __future__ import annotations

import torch

from pagedkv.tools.quant_writers import to_int32

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: column 8c + order[i] -> bits 4i of word c
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's unpack: nibble order -> column order


def quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max int4 per group of consecutive input columns (AWQ's and GPTQ's rounding):
    w [out, in] -> q [out, in] int64 0..15, scales [out, in/g] float16, zeros [out, in/g] int64 0..15."""
    out_features, in_features = w.shape
    groups = w.float().view(out_features, in_features // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(groups / scales.float().unsqueeze(-1)) + zeros.unsqueeze(-1)
    return q.clamp(0, 15).long().view(out_features, in_features), scales, zeros.long()


def to_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM packing: qweight [in, out/8], qzeros [in/g, out/8], scales [in/g, out]."""
    def pack(values: torch.Tensor) -> torch.Tensor:  # [r, out] -> [r, out/8]
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for col in range(values.shape[1] // 8):
            for i in range(8):
                words[:, col] |= values[:, col * 8 + AWQ_PACK_ORDER[i]] << (i * 4)
        return to_int32(words)

    return {"qweight": pack(q.t()), "qzeros": pack(zeros.t()), "scales": scales.t().contiguous()}


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm in fp32 -> W [out, in]."""
    shifts = torch.arange(0, 32, 4)

    def unpack(words: torch.Tensor) -> torch.Tensor:
        values = torch.bitwise_right_shift(words[:, :, None], shifts[None, None, :]).view(words.shape[0], -1)
        order = torch.arange(values.shape[-1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
        return values[:, order] & 0xF

    iweight, izeros = unpack(qweight), unpack(qzeros)
    s = scales.float().repeat_interleave(group_size, dim=0)
    z = izeros.repeat_interleave(group_size, dim=0)
    return ((iweight - z).float() * s).t()


def to_gptq(w: torch.Tensor, group_size: int, zero_offset: bool, desc_act: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's packing of w [out, in] quantized in act order (a random permutation when
    desc_act): qweight [in/8, out], qzeros [in/g, out/8] (zero - 1 when zero_offset),
    scales [in/g, out], g_idx [in] int32. Zeros of 0 are kept out of the offset format: AutoGPTQ
    packs a -1 unmasked, which spills into the word's other zeros."""
    out_features, in_features = w.shape
    order = torch.randperm(in_features) if desc_act else torch.arange(in_features)
    q_sorted, scales, zeros = quantize(w[:, order], group_size)
    if zero_offset:
        zeros = zeros.clamp(min=1)
        q_sorted = torch.round(w[:, order].float().view(out_features, -1, group_size)
                               / scales.float().unsqueeze(-1) + zeros.unsqueeze(-1)).clamp(0, 15).long()
        q_sorted = q_sorted.view(out_features, in_features)
    q = torch.empty_like(q_sorted)
    q[:, order] = q_sorted
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).to(torch.int32)
    intweight = q.t()  # [in, out]
    qweight = torch.zeros(in_features // 8, out_features, dtype=torch.int64)
    for row in range(in_features // 8):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    stored = (zeros - 1 if zero_offset else zeros).t()  # [in/g, out]
    qzeros = torch.zeros(stored.shape[0], out_features // 8, dtype=torch.int64)
    for col in range(out_features // 8):
        for j in range(8):
            qzeros[:, col] |= stored[:, col * 8 + j] << (4 * j)
    return {"qweight": to_int32(qweight), "qzeros": to_int32(qzeros), "scales": scales.t().contiguous(),
            "g_idx": g_idx}


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    zero_offset: bool) -> torch.Tensor:
    """AutoGPTQ's torch forward in fp32: scales[g_idx] * (weight - zeros[g_idx]) -> W [out, in]."""
    wf = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 8), wf.view(1, 1, 8)) & 0xF
    zeros = zeros.reshape(qzeros.shape[0], -1) + (1 if zero_offset else 0)  # [in/g, out]
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 8, -1), wf.view(1, 8, 1)) & 0xF
    weight = weight.reshape(-1, qweight.shape[1])  # [in, out]
    g = g_idx.long()
    return (scales.float()[g] * (weight - zeros[g]).float()).t()


def compressed_tensors_int4_dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                                       weight_shape: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' unpack_from_int32 (stored - 8) and dequantize (q * scale per group), in fp32."""
    out_features, in_features = weight_shape.tolist()
    unpacked = torch.zeros(out_features, in_features, dtype=torch.int32)
    for i in range(8):
        unpacked[:, i::8] = (weight_packed >> (4 * i)) & 0xF
    group_size = in_features // weight_scale.shape[1]
    scale = weight_scale.float().repeat_interleave(group_size, dim=1)
    return (unpacked - 8).float() * scale


def torchao_tile_dequantize(qdata: torch.Tensor, scale_and_zero: torch.Tensor, out_features: int,
                            in_features: int, group_size: int) -> torch.Tensor:
    """torchao's Int4TilePackedTo4dTensor read back loop by loop as torch's packing kernel
    (matrix_to_m16n8k16_Bint4_layout, 8 inner k-tiles) wrote it: lane t of [n-tile][outer k-tile]
    holds row 8 n_tile + t / 4; word w packs bytes ks[i] of that row (i = 0..3: k-tile pair 2w,
    offsets t % 4, + 4, + 8, + 12 bytes), the high nibble (even column) of byte i in bits 4i..,
    the low nibble (odd column) in bits 16 + 4i..; then tinygemm's (q - 8) * scale + zero."""
    words = qdata.tolist()
    n_pad, k_pad = qdata.shape[0] * 8, qdata.shape[1] * 128
    q = [[0] * k_pad for _ in range(n_pad)]
    for n_tile, outer in enumerate(words):
        for k_outer, lanes in enumerate(outer):
            for t, lane in enumerate(lanes):
                for j, word in enumerate(lane):
                    base = (k_outer * 8 + 2 * j) * 8
                    ks = [base + t % 4, base + t % 4 + 4, base + 8 + t % 4, base + 8 + t % 4 + 4]
                    for i, k in enumerate(ks):
                        q[n_tile * 8 + t // 4][2 * k] = (word >> (4 * i)) & 0xF
                        q[n_tile * 8 + t // 4][2 * k + 1] = (word >> (16 + 4 * i)) & 0xF
    values = torch.tensor(q, dtype=torch.float32)[:out_features, :in_features]
    scale = scale_and_zero[:, :out_features, 0].t().float().repeat_interleave(group_size, dim=1)[:, :in_features]
    zero = scale_and_zero[:, :out_features, 1].t().float().repeat_interleave(group_size, dim=1)[:, :in_features]
    return (values - 8) * scale + zero
