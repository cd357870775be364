"""benchmarks/bench_generate.py's per-step timing, which every decode benchmark reports: a (1 + new)-
token generate's time minus a 1-token one's. Where the prefill's spread swamps that difference
(session 38: -3.64 ms a step for a batch-8 MoE prefill that dequantizes every expert) it falls back
to the median of back-to-back pairs, and gives nan rather than a time that is not positive."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_generate  # noqa: E402

NEW = 4


def scripted(monkeypatch, times: list[float]):
    """bench_generate.seconds returns `times` in order, running its fn once; returns (the record of
    calls: new tokens of an untimed generate, (new tokens, repeats) of a timed one; a generate)."""
    calls, left = [], list(times)

    def seconds(fn, device, repeats=3):
        fn()
        calls[-1] = (calls[-1], repeats)
        return left.pop(0)

    def generate(ids, n):
        calls.append(n)

    monkeypatch.setattr(bench_generate, "seconds", seconds)
    return calls, generate


def test_the_difference_over_the_new_tokens(monkeypatch):
    calls, generate = scripted(monkeypatch, [0.030, 0.010])
    assert bench_generate.per_step_ms(generate, None, "cpu", NEW) == pytest.approx(1e3 * 0.020 / NEW)
    assert calls == [1 + NEW, (1 + NEW, 3), (1, 3)]  # warm-up, then the best of 3 of each


def test_a_negative_difference_takes_the_median_of_pairs(monkeypatch):
    pairs = [0.050, 0.010, 0.030, 0.060, 0.026, 0.010, 0.030, 0.012, 0.030, 0.010]  # 10, -7.5, 4, 4.5, 5 ms
    calls, generate = scripted(monkeypatch, [0.010, 0.030] + pairs)
    assert bench_generate.per_step_ms(generate, None, "cpu", NEW) == pytest.approx(4.5)
    assert calls[3:] == [1 + NEW] + [(1 + NEW, 1), (1, 1)] * 5  # a warm-up, then 5 single pairs


def test_no_positive_median_gives_nan(monkeypatch):
    calls, generate = scripted(monkeypatch, [0.010, 0.030] + [0.010, 0.030] * 5)
    assert math.isnan(bench_generate.per_step_ms(generate, None, "cpu", NEW))


def test_pairs_give_one_value_each(monkeypatch):
    _, generate = scripted(monkeypatch, [0.030, 0.010, 0.020, 0.030])
    assert bench_generate.step_ms_pairs(generate, None, "cpu", NEW, pairs=2) == pytest.approx([5.0, -2.5])
