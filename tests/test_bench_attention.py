"""benchmarks/bench_attention.py (W3) --small on the CPU with an fp8 cache: the fp8 rows time
pagedkv over e4m3 caches (no NaN byte in them), count the 1-byte K/V elements it reads, and match
dense SDPA on the dequantized cache."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_attention  # noqa: E402


def test_fp8_caches_are_random_e4m3_without_nan():
    caches, table, lens, q, kv_bytes = bench_attention.decode_batch(2, 64, "cpu", "shuffled", bench_attention.FP8)
    k, v = caches[0]
    assert k.dtype == v.dtype == torch.float8_e4m3fn
    assert kv_bytes == k.numel() + v.numel()  # 1 byte an element
    for x in (k.float(), v.float()):
        assert not x.isnan().any() and 0 < x.abs().max() < 448 and x.unique().numel() > 100
        assert abs(x.std().item() * bench_attention.FP8_SCALE - 1) < 0.1  # N(0, 1) once dequantized


def test_small_fp8_run(tmp_path):
    bench_attention.main(["--small", "--device", "cpu", "--kv-dtypes", "fp8", "--out", str(tmp_path)])
    lines = (tmp_path / "bench_attention.md").read_text().splitlines()
    assert "fp8 e4m3 caches" in lines[0] and "bf16 caches" not in lines[0]
    points = [f"{b}x{c}" for b, c in bench_attention.SMALL_POINTS]
    rows = [line.split(" | ") for line in lines if line.split(" | ")[0].removeprefix("| ") in points]
    assert [r[0].removeprefix("| ") for r in rows] == points  # one table: the fp8 cache's
    for r in rows:
        assert float(r[4]) > 0 and r[7] == "n/a"  # GB/s; no bf16 rows to compare with
        assert float(r[8].rstrip(" |")) < 0.02  # vs SDPA on the dequantized cache, bf16 out
    assert (tmp_path / "bench_attention.png").stat().st_size > 0


def test_unknown_kv_dtype_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_attention.main(["--small", "--device", "cpu", "--kv-dtypes", "bf16,fp16"])
    assert "a comma-separated list of bf16, fp8" in capsys.readouterr().err
