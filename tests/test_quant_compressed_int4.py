"""compressed-tensors W4A16 ("pack-quantized", symmetric) read into the int4 canonical form,
against the format's own unpack and dequantization (tests/int4_formats.py), and through the
linear_w4a16 op against a plain-PyTorch linear with the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from int4_formats import compressed_tensors_int4_dequantize
from pagedkv.quant import dequantize, linear_w4a16_weight, pack_w4a16
from pagedkv.quant.int4 import from_compressed_tensors_int4
from pagedkv.tools.quant_writers import to_compressed_tensors_int4

SHAPES = [(256, 64), (512, 200), (128, 8)]  # (in, out)
GROUPS = [32, 128, -1]  # -1: strategy "channel", one group a row
SCALE_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("in_features,out_features", SHAPES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_round_trip_and_linear(in_features, out_features, group, scale_dtype):
    if group != -1 and in_features % group:
        pytest.skip("group does not divide in_features")
    g = in_features if group == -1 else group
    w = torch.randn(out_features, in_features) * 0.05
    stored = to_compressed_tensors_int4(w, g, scale_dtype)
    canonical = from_compressed_tensors_int4(**stored, group_size=group)
    want = compressed_tensors_int4_dequantize(**stored)
    assert torch.equal(dequantize(canonical), want)
    assert (want - w).abs().max() <= w.abs().max() / 7.5  # within half a step of the largest group's
    x = torch.randn(3, in_features)
    got = linear_w4a16_weight(x, pack_w4a16(canonical))
    torch.testing.assert_close(got, F.linear(x, want), rtol=1e-5, atol=1e-5)


def test_bad_tensors_are_named():
    stored = to_compressed_tensors_int4(torch.randn(64, 256), 128)
    with pytest.raises(ValueError, match=r"weight_scale must be \[64, 2\]"):
        from_compressed_tensors_int4(**{**stored, "weight_scale": stored["weight_scale"][:, :1]}, group_size=128)
    with pytest.raises(ValueError, match="weight_scale must be .* of torch.float16, torch.bfloat16"):
        from_compressed_tensors_int4(**{**stored, "weight_scale": stored["weight_scale"].float()}, group_size=128)
    with pytest.raises(ValueError, match=r"weight_packed must be \[64, 32\] of torch.int32"):
        from_compressed_tensors_int4(**{**stored, "weight_packed": stored["weight_packed"][:, :16]}, group_size=128)
    with pytest.raises(ValueError, match="group_size 96 must be -1 or a positive divisor"):
        from_compressed_tensors_int4(**stored, group_size=96)
    with pytest.raises(ValueError, match="weight_shape must hold"):
        from_compressed_tensors_int4(**{**stored, "weight_shape": torch.tensor([64])}, group_size=128)


def test_writer_packs_as_compressed_tensors_does():
    """Where compressed-tensors is installed: its pack_to_int32 of the writer's values gives the
    writer's words (the module moved between versions)."""
    pytest.importorskip("compressed_tensors")
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    except ImportError:
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32, unpack_from_int32
    stored = to_compressed_tensors_int4(torch.randn(64, 256), 128)
    q = unpack_from_int32(stored["weight_packed"], 4, torch.Size([64, 256]))  # int8, -8..7
    assert torch.equal(pack_to_int32(q, 4), stored["weight_packed"])
    canonical = from_compressed_tensors_int4(**stored, group_size=128)
    assert torch.equal(canonical.q.long() - 8, q.long())
