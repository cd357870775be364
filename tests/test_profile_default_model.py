"""python -m pagedkv.tools.profile on the real default model (SmolLM2-135M-Instruct, GGUF) on the
CPU, run as a user runs it (a subprocess): the PNG beside the JSON, none of torch.profiler's
Kineto log lines over the table, counts as integers and CPU words ("ops", not "kernels")."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("gguf", reason="the default model loads through gguf")
pytest.importorskip("matplotlib", reason="the plot is drawn with matplotlib")
default_model = pytest.importorskip("pagedkv.tools.default_model")

# What Kineto writes straight to fd 2 on each profiler start/stop, and without a GPU.
NOISE = ("USDT:", "STAGE:", "gpuGetDeviceCount failed", "SyncActivityProfilerHandler")


def run_cli(tmp_path, model: str, *extra: str) -> str:
    try:
        default_model.default_model_dir()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(str(err))
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv.tools.profile", "--model", model, "--batch", "1", "--prompt", "16",
         "--new", "4", "--device", "cpu", "--out", str(tmp_path), *extra],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_smollm2_profile_writes_a_png_without_profiler_noise(tmp_path):
    printed = run_cli(tmp_path, "smollm2")
    noisy = [line for line in printed.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, noisy[:5]
    png = tmp_path / "profile.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["model"] == "smollm2" and [p["system"] for p in saved["profiles"]] == ["pagedkv", "HF generate"]
    assert "SmolLM2" in printed.splitlines()[0] or "smollm2" in printed.splitlines()[0]
    # The CPU has ops, not kernels; counts are whole numbers, times carry their unit.
    table = printed[printed.index("wall / step"):]
    assert "kernel" not in table.lower()
    ops_row = next(line for line in table.splitlines() if line.startswith("ops / step"))
    counts = ops_row.split()[3:]
    assert len(counts) == 2 and all(re.fullmatch(r"\d+", c) and int(c) > 0 for c in counts), ops_row
    top = table[table.index("top ops per step, pagedkv"):].splitlines()[1:4]
    for line in top:
        assert re.match(r"\s+[\d.]+ (ms|us)\s+\d+ x\s+\S", line), line
    assert " 0 x " not in table  # an op run once per call is no per-step op


def test_a_gguf_file_path_loads_too(tmp_path):
    try:
        gguf = default_model.default_model_dir() / default_model.GGUF_FILE
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(str(err))
    printed = run_cli(tmp_path, str(gguf), "--compare", "none")
    assert "pagedkv" in printed and (tmp_path / "profile.png").exists()


def test_an_unknown_model_names_what_is_allowed(capsys):
    from pagedkv.tools import profile

    with pytest.raises(SystemExit) as err:
        profile.load_model("no-such-model", torch.device("cpu"), torch.float32)
    assert "smollm2" in str(err.value) and ".gguf" in str(err.value)
