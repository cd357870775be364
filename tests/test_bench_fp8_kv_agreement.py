"""benchmarks/bench_fp8_kv_agreement.py --small on the CPU (the real SmolLM2 in fp32): a row per
cache, the control (the model-dtype cache, teacher-forced through the same logits processor)
agreeing at every position, the FP8 rows counted over the same positions, and its plot."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))


def test_small_run(tmp_path):
    pytest.importorskip("gguf", reason="the default model loads through gguf")
    from pagedkv.tools import default_model

    try:
        default_model.default_model_dir()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(str(err))
    import bench_fp8_kv_agreement

    rates = bench_fp8_kv_agreement.main(["--small", "--out", str(tmp_path)])
    assert list(rates) == ["model-dtype cache (control)", "fp8, calibrated scales", "fp8, scales 1.0"]
    assert rates["model-dtype cache (control)"] == 1.0
    assert all(0.5 < rate <= 1.0 for rate in rates.values()), rates
    text = (tmp_path / "bench_fp8_kv_agreement.md").read_text()
    assert "8 / 8" in text and (tmp_path / "bench_fp8_kv_agreement.png").exists()
