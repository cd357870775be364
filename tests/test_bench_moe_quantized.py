"""benchmarks/bench_moe_quantized.py in its --small mode (CPU): a row per format and path (the
quantized expert kernels, the dequantizing path) beside pagedkv bf16; and the MoE checkpoints
benchmarks/quantized_w1.py writes hold every expert quantized under the names save_pretrained gives
them, so pagedkv reads them as FP8 / int4 experts (not dense), each the model's own expert up to
the format's rounding (gate and up in their places)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from safetensors.torch import load_file

import pagedkv
from pagedkv.layers.moe_quantized import Fp8Experts, Int4Experts, dequantize_experts

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_moe_quantized  # noqa: E402
from quantized_w1 import FORMATS, write_checkpoint  # noqa: E402


def test_small_run_has_a_row_per_format_and_path(tmp_path):
    bench_moe_quantized.main(["--small", "--batches", "1", "--new", "2", "--out", str(tmp_path)])
    text = (tmp_path / "bench_moe_quantized.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 |")]
    assert [r[1] for r in rows] == ["pagedkv bf16", "pagedkv fp8", "pagedkv fp8, experts dequantized each step",
                                    "pagedkv int4", "pagedkv int4, experts dequantized each step"]
    for row in rows:  # ms / step is a median of differences of two timings: "unstable" where not > 0
        assert row[2] == "unstable" or float(row[2]) > 0
        low, high = (float(v) for v in row[3].split(" to "))
        assert low <= high
        assert float(row[4]) > 0  # the roofline
    assert (tmp_path / "bench_moe_quantized.png").stat().st_size > 0


def test_kernels_only_leaves_out_the_dequantizing_rows(tmp_path):
    bench_moe_quantized.main(["--small", "--batches", "1", "--new", "2", "--formats", "int4", "--kernels-only",
                              "--out", str(tmp_path)])
    text = (tmp_path / "bench_moe_quantized.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 |")]
    assert [r[1] for r in rows] == ["pagedkv bf16", "pagedkv int4"]


@pytest.mark.parametrize("key", ["fp8", "int4"])
def test_checkpoint_holds_every_expert_quantized(tmp_path, key):
    model = bench_moe_quantized.build_model(True, 2, "cpu")
    write_checkpoint(model, tmp_path, FORMATS[key], progress=False)
    stored = {}
    for file in tmp_path.glob("*.safetensors"):
        stored.update(load_file(file))
    num_experts = model.config.num_experts
    for layer in range(2):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = [n for n in stored if n.startswith(f"model.layers.{layer}.mlp.experts.") and f".{proj}." in n]
            assert {n.split(".")[5] for n in names} == {str(e) for e in range(num_experts)}
    quantized = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    form = Fp8Experts if key == "fp8" else Int4Experts
    layers = quantized._pagedkv_model.weights.layers
    assert all(isinstance(p, form) for layer in layers for p in (*layer.moe.gate_up, layer.moe.down))
    ids = torch.arange(num_experts)
    for i, layer in enumerate(layers):
        experts = model.model.layers[i].mlp.experts
        gate, up = (dequantize_experts(p, ids, torch.float32) for p in layer.moe.gate_up)
        held = {"gate": gate, "up": up, "down": dequantize_experts(layer.moe.down, ids, torch.float32)}
        inter = gate.shape[1]
        wanted = {"gate": experts.gate_up_proj[:, :inter], "up": experts.gate_up_proj[:, inter:],
                  "down": experts.down_proj}
        for name, w in held.items():  # e4m3 keeps ~3 significant bits, int4 16 levels a group
            cosine = torch.nn.functional.cosine_similarity(w.flatten(1), wanted[name].detach().flatten(1)).min()
            assert cosine > (0.99 if key == "fp8" else 0.9), (i, name, float(cosine))
