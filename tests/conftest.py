"""Shared test set-up: the `cuda` marker skips without a GPU; DEVICES parametrizes CPU and CUDA."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Every op test runs on both; the CUDA case carries the `cuda` marker (run with `pytest -m cuda`).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
