"""The extension loads once, reports what it was built with, and explains a failed load."""

from __future__ import annotations

import importlib

import pytest
import torch

import pagedkv
from pagedkv import _ext


def test_build_info_names_what_was_built():
    assert pagedkv.build_info.startswith("CPU")
    assert pagedkv.build_info.startswith("CPU + CUDA") == pagedkv.with_cuda
    assert hasattr(torch.ops.pagedkv, "rms_norm")


@pytest.mark.cuda
def test_cuda_kernels_are_built():
    assert pagedkv.with_cuda, f"running on a GPU machine with a CPU-only build: {pagedkv.build_info}"


def test_failed_load_says_where_it_looked_and_how_to_rebuild(monkeypatch):
    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ImportError) as err:
        _ext.load_extension()
    message = str(err.value)
    assert "Looked in" in message and "pagedkv" in message
    assert "pip install --no-build-isolation -e ." in message


def test_build_records_the_torch_it_was_built_for():
    assert _ext.built_for_torch() == str(torch.__version__)
    assert f"torch {torch.__version__}" in pagedkv.build_info


def test_another_torch_is_refused_with_both_versions_and_the_rebuild(monkeypatch):
    built = str(torch.__version__)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    with pytest.raises(ImportError) as err:
        _ext.load_extension()
    message = str(err.value)
    assert f"built for torch {built}" in message and "this is torch 9.9.9" in message
    assert "pip install --no-build-isolation" in message
