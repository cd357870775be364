"""examples/compare.ipynb executes top to bottom headless on the real default model
(SmolLM2-135M-Instruct) on the CPU, with CI-short settings from its environment variables."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("nbconvert")
pytest.importorskip("ipykernel")
pytest.importorskip("gguf", reason="the default model loads through gguf")
default_model = pytest.importorskip("pagedkv.tools.default_model")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "examples" / "compare.ipynb"
# 4 decode steps, 2 repeats, 2 batch sizes and 2 contexts: every cell and plot, in CI time.
SHORT = {"PAGEDKV_NOTEBOOK_STEPS": "4", "PAGEDKV_NOTEBOOK_REPEATS": "2",
         "PAGEDKV_NOTEBOOK_BATCHES": "1,2", "PAGEDKV_NOTEBOOK_CONTEXTS": "16,32"}


def test_compare_notebook_executes_on_the_default_model(tmp_path):
    try:
        default_model.default_model_dir()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(str(err))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_NOTEBOOK_")}
    env.update(SHORT, CUDA_VISIBLE_DEVICES="")  # CPU, as in CI, even on a GPU machine
    result = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
         "--ExecutePreprocessor.timeout=600", "--output-dir", str(tmp_path), str(NOTEBOOK)],
        capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    cells = json.loads((tmp_path / "compare.ipynb").read_text())["cells"]
    outputs = [o for c in cells if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = "".join("".join(o.get("text", "")) for o in outputs)
    assert "SmolLM2-135M-Instruct, CPU" in text and "float32" in text  # the real model, said so
    assert "4 decode steps, 2 repeats" in text  # the settings came from the environment
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # tokens/s by batch, by context, one step
    assert "USDT:" not in text and "gpuGetDeviceCount" not in text  # the profiler's log lines
