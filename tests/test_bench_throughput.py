"""benchmarks/bench_throughput.py (W2) on the CPU: its bound counts each cache's K/V bytes (an fp8
cache's at 1 byte an element, the weights unchanged), each row is held to its own cache's bound,
and --small with --kv-cache-dtype fp8 runs pagedkv.LLM on an e4m3 cache and says so."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_throughput  # noqa: E402
from throughput_bound import w2_bound_seconds  # noqa: E402

COPY_GBS, TFLOPS = 1.0, 100.0  # 1 GB/s: decode seconds * 1e9 are the bytes read


@pytest.fixture(scope="module")
def small():
    """The --small model (fp32: 4 bytes an element) and a short workload."""
    model = bench_throughput.build_model(True, "cpu")
    prompts, max_tokens = bench_throughput.workload(6, 10, 40)
    return model, prompts, max_tokens


def test_fp8_bound_counts_one_byte_per_kv_element(small):
    model, prompts, max_tokens = small
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes, prefill = {}, set()
    for size in (None, 4, 2, 1):
        decode_s, prefill_s = w2_bound_seconds(model, prompts, max_tokens, COPY_GBS, TFLOPS, size)
        kv_bytes[size] = decode_s * 1e9 - weight_bytes * max(max_tokens)  # every step reads the weights
        prefill.add(prefill_s)
    assert kv_bytes[None] == kv_bytes[4]  # the default: the model's dtype
    assert kv_bytes[1] > 0 and len(prefill) == 1
    assert kv_bytes[2] == pytest.approx(2 * kv_bytes[1], rel=1e-9)
    assert kv_bytes[4] == pytest.approx(4 * kv_bytes[1], rel=1e-9)


def test_each_cache_gets_its_own_bound(small):
    bounds, note = bench_throughput.kv_bounds(*small, COPY_GBS, TFLOPS, kv_size=1)
    assert sorted(bounds) == [1, 4] and bounds[1] > bounds[4]
    assert "at 1 B an element (pagedkv's cache" in note and "at 4 B an element (HF's cache" in note
    bounds, note = bench_throughput.kv_bounds(*small, COPY_GBS, TFLOPS, kv_size=4)
    assert list(bounds) == [4] and "pagedkv's and HF's caches" in note


def test_small_fp8_run(tmp_path):
    bench_throughput.main(["--small", "--kv-cache-dtype", "fp8", "--no-hf", "--out", str(tmp_path)])
    text = (tmp_path / "bench_throughput.md").read_text()
    title, row = text.splitlines()[0], next(line for line in text.splitlines() if line.startswith("| pagedkv.LLM |"))
    assert "pagedkv's KV cache: fp8 e4m3, scale 1 (K and V, every layer); torch.float8_e4m3fn" in title
    assert "| fp8 e4m3" in row and float(row.split(" | ")[4]) > 0  # tok/s
    assert (tmp_path / "bench_throughput.png").stat().st_size > 0
