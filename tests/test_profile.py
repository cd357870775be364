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
    for row in ("wall / step, not profiled", "wall / step, profiled", "host time outside ops share", "ops / step",
                "host syncs / step", "top ops per step, HF generate"):
        assert row in printed
    assert "kernel" not in printed.lower()  # a CPU runs ops
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
    assert (tmp_path / "profile.png").read_bytes()[:4] == b"\x89PNG"


def test_counts_print_as_integers_and_times_with_their_unit():
    from pagedkv.tools.profiling import fmt_bytes, fmt_count, fmt_ms

    assert [fmt_count(12.0), fmt_count(0.5), fmt_count(3 - 1e-9)] == ["12", "0.50", "3"]
    assert [fmt_ms(18.452), fmt_ms(0.178), fmt_ms(float("nan"))] == ["18.5 ms", "178 us", "-"]
    assert [fmt_bytes(26_700), fmt_bytes(3.31e6), fmt_bytes(12)] == ["26.7 KB", "3.31 MB", "12 B"]


def test_kernel_and_op_names_fall_in_categories():
    from pagedkv.tools.profiling import category

    assert category("pagedkv::linear") == category("aten::addmm") == "matmul"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "matmul"
    # cuBLAS's GEMMs on an H100 (torch 2.11, CUDA 13), HF's and the compiled decoder's matmuls
    assert category("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "matmul"
    assert category("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>") == "matmul"
    assert category("pagedkv::paged_decode_attention") == category("aten::scaled_dot_product_attention") \
        == "attention"
    assert category("pagedkv::fused_add_rms_norm") == "norm"
    assert category("aten::cat") == "copy / cache" and category("aten::mul") == "elementwise"
    assert category("aten::arange") == "other"


def test_kineto_log_lines_are_dropped_and_others_kept(capfd):
    import os

    from pagedkv.tools.profiling import quiet_kineto

    with quiet_kineto():
        os.write(2, b"USDT:2026 1:1 SyncActivityProfilerHandler.cpp:39] profiler_start\n")
        os.write(2, b"ERROR:2026 1:1 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n")
        os.write(2, b"a real error\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "gpuGetDeviceCount" not in err and "a real error" in err


def test_profile_cli_compares_with_the_static_cache_decoder(tmp_path, capsys):
    profiles = profile.main(["--model", "tiny", "--batch", "2", "--prompt", "12", "--new", "4",
                             "--device", "cpu", "--compare", "compiled", "--compiled-mode", "none",
                             "--out", str(tmp_path)])
    ours, baseline = profiles
    assert baseline.system == "PyTorch static cache (eager)"
    assert "top ops per step, PyTorch static cache (eager)" in capsys.readouterr().out
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
        return RunTrace(wall, 1.0, 1.0, 1, 0, 0, 0, {"k": (1.0, 1)}, {}, {},
                        {"k": (idle, 1)} if idle is not None else {})

    noisy, calm, slow = run(5.0, 3.0), run(6.0, 0.5), run(9.0, 0.5)
    assert quietest([noisy, calm, slow]) is calm
    cpu_fast, cpu_slow = run(2.0, None), run(3.0, None)
    assert quietest([cpu_slow, cpu_fast]) is cpu_fast


def test_a_phase_that_does_not_repeat_per_step_has_no_per_step_time():
    """Inside a replayed CUDA graph, "sample" runs on the host only for the first token: the long
    and the short run enter it equally often, and their time difference is noise (it printed
    -1.25 us a step on an H100), not a per-step time."""
    from pagedkv.tools.profiling import RunTrace, _phase_ms

    def run(phases, counts):
        return RunTrace(1.0, 1.0, 1.0, 1, 0, 0, 0, {}, phases, counts)

    short = run({"sample": 0.010, "decode_step": 0.5}, {"sample": 1, "decode_step": 4})
    long = run({"sample": 0.009, "decode_step": 1.5}, {"sample": 1, "decode_step": 12})
    assert _phase_ms("sample", short, long, 8) is None
    assert math.isclose(_phase_ms("decode_step", short, long, 8), 1.0 / 8)
    assert _phase_ms("metadata", short, long, 8) is None  # never entered


def test_a_kernel_launched_early_is_charged_only_the_time_it_holds_the_device_alone():
    """Programmatic dependent launch starts a kernel while the one before it still runs (it waits
    inside): its profiled span overlaps, and plain durations summed to more than the step."""
    from pagedkv.tools.profiling import _busy_per_kernel, _union_ms

    # (start us, end us, name): norm starts at 8 while gemv runs to 10; gemv2 overlaps norm.
    kernels = [(12.0, 20.0, "gemv"), (0.0, 10.0, "gemv"), (8.0, 11.0, "norm"), (30.0, 31.0, "norm")]
    table = _busy_per_kernel(kernels)
    assert math.isclose(table["gemv"][0], (10.0 + 8.0) / 1e3) and table["gemv"][1] == 2
    assert math.isclose(table["norm"][0], (1.0 + 1.0) / 1e3) and table["norm"][1] == 2
    total = sum(ms for ms, _ in table.values())
    assert math.isclose(total, _union_ms([(a, b) for a, b, _ in kernels]))
    # A kernel entirely inside another's span holds the device alone for no time at all.
    assert _busy_per_kernel([(0.0, 10.0, "a"), (2.0, 5.0, "b")])["b"] == (0.0, 1)
