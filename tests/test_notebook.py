"""examples/compare.ipynb executes top to bottom headless (tiny model on the CPU in CI)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("nbconvert")
pytest.importorskip("ipykernel")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "examples" / "compare.ipynb"


def test_compare_notebook_executes(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
         "--ExecutePreprocessor.timeout=600", "--output-dir", str(tmp_path), str(NOTEBOOK)],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    executed = (tmp_path / "compare.ipynb").read_text()
    assert '"output_type": "error"' not in executed
    assert "image/png" in executed  # the plots were drawn
