"""Shared test set-up: the `cuda` marker skips without a GPU; DEVICES parametrizes CPU and CUDA.

PAGEDKV_TEST_SHARD=i/n keeps every n-th selected test starting at the i-th (after -k/-m), so
slow runs (compute-sanitizer) can be spread over several processes.
"""

from __future__ import annotations

import os
import sys

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


@pytest.fixture(autouse=True)
def _no_exception_left_handled():
    """Fails a test after which an exception is still "being handled" (sys.exc_info() set): every
    later exception would chain to it through __context__ and keep its frames, and with them
    every engine and KV cache those frames hold (on CUDA: out of memory in later tests)."""
    before = sys.exc_info()[1]
    yield
    left = exception_left_handled(before)
    if left:
        pytest.fail(left, pytrace=False)


def exception_left_handled(before: BaseException | None) -> str | None:
    """What is being handled now that was not at `before`, or None. (Inside pytest.raises or an
    except block of the test the state is restored when the block exits, before this runs.)"""
    left = sys.exc_info()[1]
    if left is None or left is before:
        return None
    return (f"the test left {type(left).__name__}({str(left)[:200]!r}) being handled (sys.exc_info() "
            f"is still set after it); tests/interrupts.py in_thread says how that happens")


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
