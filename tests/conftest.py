"""Shared test set-up: the `cuda` marker skips without a GPU; DEVICES parametrizes CPU and CUDA.

PAGEDKV_TEST_SHARD=i/n keeps every n-th selected test starting at the i-th (after -k/-m), so
slow runs (compute-sanitizer) can be spread over several processes.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Every op test runs on both; the CUDA case carries the `cuda` marker (run with `pytest -m cuda`).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.hookimpl(trylast=True)  # after -k/-m deselection, so shards split what actually runs
def pytest_collection_modifyitems(config, items):
    shard = os.environ.get("PAGEDKV_TEST_SHARD")
    if shard:
        index, count = _parse_shard(shard)
        keep = [item for i, item in enumerate(items) if i % count == index]
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
        items[:] = keep
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_make_parametrize_id(config, val, argname):
    # "bfloat16" instead of "dtype2" in test ids: -k can select a dtype across every test file.
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise pytest.UsageError(f"PAGEDKV_TEST_SHARD={text!r}: expected i/n with 0 <= i < n, e.g. 0/4")
    return index, count


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=[False, True], ids=["serial", "overlap"])
def engine_overlap(request, monkeypatch):
    """Engines made without an overlap_steps argument run serially, then overlapped (each step
    launched before the one before it is read back; on CUDA the default, here forced on the CPU
    so that every engine test also checks the overlapped step loop). Use with
    pytestmark = pytest.mark.usefixtures("engine_overlap")."""
    import pagedkv.engine.llm as llm_module

    default = request.param
    monkeypatch.setattr(llm_module, "overlap_wanted",
                        lambda requested, device: default if requested is None else bool(requested))
    return default
