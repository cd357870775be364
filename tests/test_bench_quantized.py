"""benchmarks/bench_quantized.py in its --small mode (CPU): its table has a pagedkv row per format
and batch beside pagedkv bf16, with HF's rows reported n/a rather than crashing the run; and the
checkpoints it writes (benchmarks/quantized_w1.py) are what they claim: pagedkv's greedy tokens
on each equal HF generate on the same model holding the weights the format's own dequantization
formula (tests/fp8_formats.py, int4_formats.py, nf4_formats.py) reads from the written files."""

from __future__ import annotations

import copy
import json
import pathlib
import sys

import pytest
import torch
from safetensors.torch import load_file

import pagedkv
from fp8_formats import finegrained_dequantize
from int4_formats import compressed_tensors_int4_dequantize, torchao_tile_dequantize
from int8_formats import bnb_int8_dequantize
from nf4_formats import bnb_dequantize
from test_engine import random_prompts

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_quantized  # noqa: E402
from quantized_w1 import FORMATS, is_quantized_linear, write_checkpoint  # noqa: E402

GREEDY = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_small_run_has_a_row_per_format(tmp_path):
    bench_quantized.main(["--small", "--batches", "1", "--new", "4", "--out", str(tmp_path)])
    text = (tmp_path / "bench_quantized.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 1 |")]
    assert sorted(r[1] for r in rows) == ["pagedkv bf16", "pagedkv fp8", "pagedkv int4", "pagedkv nf4"]
    for row in rows:  # ms / step: positive, or nan where the timings' noise left no positive difference
        assert (float(row[2]) > 0 or row[2] == "nan") and float(row[4]) > 0 and row[5].endswith("%")
    for key in ("fp8", "int4", "nf4"):  # the default --formats
        assert f"HF {key}: n/a: --small" in text
    assert (tmp_path / "bench_quantized.png").stat().st_size > 0


@pytest.mark.parametrize("option,value", [("--batches", "0"), ("--batches", "1,x"), ("--torchao-batches", "''")])
def test_bad_batches_are_named(option, value, capsys):
    with pytest.raises(SystemExit):
        bench_quantized.main([option, value, "--device", "cpu"])
    assert f"{option} takes positive batch sizes joined by commas (e.g. 1,8), got {value!r}" in capsys.readouterr().err


def dequantized(folder: pathlib.Path, key: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Every tensor of the written checkpoint, each decoder linear's weight as its format's own
    formula reads it back from the files (fp32). shapes: the model's parameter shapes (torchao
    stores its weights padded)."""
    stored = {}
    for file in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(file))
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(stored)
    # the linears' prefixes (model.layers.0.self_attn.q_proj): their tensors but the bias
    prefixes = {n.split("_proj.")[0] + "_proj" for n in stored if "_proj." in n and not n.endswith(".bias")}
    out = {}
    for prefix in prefixes:
        parts = {n[len(prefix) + 1:]: t for n, t in stored.items() if n.startswith(prefix + ".")}
        parts.pop("bias", None)
        if key == "fp8":
            w = finegrained_dequantize(parts["weight"], parts["weight_scale_inv"], (128, 128))
        elif key == "int4":
            w = compressed_tensors_int4_dequantize(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"])
        elif key == "int4-torchao":
            w = torchao_tile_dequantize(parts["_weight_qdata"], parts["_weight_scale_and_zero"],
                                        *shapes[f"{prefix}.weight"], group_size=128)
        elif key == "int8":
            w = bnb_int8_dequantize(parts)
        else:
            w = bnb_dequantize(parts)
        out[f"{prefix}.weight"] = w
    for name, t in stored.items():
        if not any(name.startswith(p + ".") for p in prefixes) or name.endswith(".bias"):
            out[name] = t.float()
    return out


@pytest.mark.parametrize("key", list(FORMATS))
def test_written_checkpoint_gives_the_dequantized_models_tokens(tmp_path, key):
    model = bench_quantized.build_model(small=True, layers=2, device="cpu")
    write_checkpoint(model, tmp_path, FORMATS[key], progress=False)
    reference = copy.deepcopy(model)
    weights = dequantized(tmp_path, key, {n: tuple(p.shape) for n, p in model.named_parameters()})
    assert {n for n, _ in reference.named_parameters()} == set(weights)
    assert sum(is_quantized_linear(n) for n in weights) == 7 * 2
    for name, p in reference.named_parameters():
        p.data.copy_(weights[name])
        if is_quantized_linear(name):  # quantized: near the weight it was written from, not equal
            w = model.get_parameter(name)
            assert 0 < (p - w).abs().max() < 0.2 * w.abs().max()
    quantized = pagedkv.from_pretrained_quantized(tmp_path, dtype=torch.float32, device="cpu")
    ids = torch.tensor(random_prompts([9, 9], seed=3))
    assert torch.equal(pagedkv.generate(quantized, ids, **GREEDY), reference.generate(ids, **GREEDY))
