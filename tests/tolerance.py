"""Tolerances tied to a same-dtype PyTorch baseline (the flash-attention test convention): a
kernel's error against an fp64 reference may be at most twice the error of plain PyTorch run in
the kernel's dtype, plus a floor of a few units in the last place of that dtype."""

from __future__ import annotations

import torch


def assert_close_to_baseline(
    out: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor, name: str = "output"
) -> None:
    """out, baseline: results in the tested dtype; reference: the same function in float64."""
    assert not torch.isnan(out).any(), f"{name} has NaN: an element was not written"
    ref = reference.double().cpu()
    out_err = (out.double().cpu() - ref).abs().max().item()
    base_err = (baseline.double().cpu() - ref).abs().max().item()
    floor = 4 * torch.finfo(out.dtype).eps * max(ref.abs().max().item(), 1.0)
    assert out_err <= 2 * base_err + floor, (
        f"{name}: max error {out_err:.3g} vs fp64 reference exceeds 2 x the same-dtype PyTorch "
        f"error {base_err:.3g} + floor {floor:.3g}"
    )


def assert_tokens_equal_up_to_near_tie(got: torch.Tensor, hf_output, start: int) -> None:
    """bf16 greedy generation: each row of got [B, S + N] equals HF's sequences up to its first
    difference, which must come where HF's top two logits nearly tie (the usual allowance).
    hf_output: HF's generate output with output_logits; start: the prompt width S."""
    for row in range(got.shape[0]):
        for step, logits in enumerate(hf_output.logits):
            if got[row, start + step] != hf_output.sequences[row, start + step]:
                top2 = logits[row].float().topk(2).values
                assert top2[0] - top2[1] < 0.05 * top2[0].abs() + 0.1, (
                    f"row {row} step {step}: tokens differ without a near-tie in HF's logits")
                break
