"""python -m pagedkv.tools.profile on the CPU with a tiny model: the table, the JSON and the traces."""

from __future__ import annotations

import json
import math

import pytest

from pagedkv.tools import profile


def test_profile_cli_compares_with_hf(tmp_path, capsys):
    profiles = profile.main(["--model", "tiny", "--batch", "2", "--prompt", "12", "--new", "4",
                             "--device", "cpu", "--out", str(tmp_path)])
    ours, hf = profiles
    printed = capsys.readouterr().out
    for row in ("wall ms / step, not profiled", "wall ms / step, profiled", "idle gap share", "kernel launches / step", "host syncs / step",
                "top kernels per step, HF generate"):
        assert row in printed
    assert ours.system == "pagedkv" and hf.system == "HF generate"
    assert ours.kernels > 0 and hf.kernels > 0  # counts: exact differences of the two runs
    # Times per step are differences of two short timed runs of a tiny model: finite, but on a
    # loaded CPU noise can push them either way.
    for p in (ours, hf):
        assert math.isfinite(p.wall_ms) and math.isfinite(p.unprofiled_wall_ms)
    assert ours.phases_ms["decode_step"] > 0  # pagedkv's labels are in the trace
    assert hf.phases_ms["cache_update"] > 0  # HF's DynamicCache updates were labelled
    assert any(name.startswith("pagedkv::") for name, _, _ in ours.top_kernels)
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert [p["system"] for p in saved["profiles"]] == ["pagedkv", "HF generate"]
    assert (tmp_path / "trace_pagedkv.json").stat().st_size > 0
    assert (tmp_path / "trace_hf.json").stat().st_size > 0


def test_profile_cli_compares_with_the_static_cache_decoder(tmp_path, capsys):
    profiles = profile.main(["--model", "tiny", "--batch", "2", "--prompt", "12", "--new", "4",
                             "--device", "cpu", "--compare", "compiled", "--compiled-mode", "none",
                             "--out", str(tmp_path)])
    ours, baseline = profiles
    assert baseline.system == "PyTorch static cache (eager)"
    assert "top kernels per step, PyTorch static cache (eager)" in capsys.readouterr().out
    assert baseline.kernels > 0 and math.isfinite(baseline.unprofiled_wall_ms)
    assert baseline.phases_ms["decode_step"] is None  # pagedkv's labels are pagedkv's alone
    assert (tmp_path / "trace_pytorch.json").stat().st_size > 0


def test_profile_cli_refuses_an_unknown_comparison():
    with pytest.raises(SystemExit):
        profile.main(["--model", "tiny", "--device", "cpu", "--compare", "hf,vllm"])


def test_idle_gaps_are_charged_to_the_kernel_that_ends_them():
    from pagedkv.tools.profiling import _gaps_before

    # (start us, end us, name), out of order; c overlaps b, so no idle time before c.
    kernels = [(40.0, 50.0, "b"), (0.0, 10.0, "a"), (18.0, 30.0, "c"), (15.0, 20.0, "b")]
    table = _gaps_before(kernels)
    assert table["a"] == (0.0, 1)
    assert table["c"] == (0.0, 1)
    ms, calls = table["b"]
    assert calls == 2 and math.isclose(ms, (5.0 + 10.0) / 1e3)


def test_the_quietest_run_is_the_one_with_least_device_idle():
    from pagedkv.tools.profiling import RunTrace, quietest

    def run(wall, idle):
        return RunTrace(wall, 1.0, 1.0, 1, 0, 0, 0, {"k": (1.0, 1)}, {},
                        {"k": (idle, 1)} if idle is not None else {})

    noisy, calm, slow = run(5.0, 3.0), run(6.0, 0.5), run(9.0, 0.5)
    assert quietest([noisy, calm, slow]) is calm
    cpu_fast, cpu_slow = run(2.0, None), run(3.0, None)
    assert quietest([cpu_slow, cpu_fast]) is cpu_fast
