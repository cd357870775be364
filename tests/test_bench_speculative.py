"""Issue 34's benchmarks in their --small modes (CPU): bench_prompt_lookup.py on the real SmolLM2
(a row per system, pagedkv's prompt-lookup tokens equal to its greedy tokens, proposals counted and
some accepted), its prompt set as the issue asks (>= 20 input-grounded prompts of 150-600 tokens
once chat-formatted), and bench_verify_step.py (a row per batch and k, the goal line printed)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_prompt_lookup  # noqa: E402
import bench_verify_step  # noqa: E402


def table_rows(path: pathlib.Path) -> list[list[str]]:
    """The markdown table's body rows, cells stripped."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("| ")][1:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gguf", reason="the default model loads through gguf")
    from pagedkv.tools import default_model
    from transformers import AutoTokenizer

    try:
        folder = default_model.default_model_dir()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        pytest.skip(str(err))
    return AutoTokenizer.from_pretrained(folder, gguf_file=default_model.GGUF_FILE)


def test_prompt_set_is_input_grounded_and_sized(tokenizer):
    records = [json.loads(line) for line in bench_prompt_lookup.PROMPTS.read_text().splitlines()]
    assert len(records) >= 20 and len({r["id"] for r in records}) == len(records)
    assert {"summarise", "rewrite", "edit", "fix code"} <= {r["task"] for r in records}
    lengths = [len(ids) for ids in bench_prompt_lookup.load_prompts(bench_prompt_lookup.PROMPTS, tokenizer)]
    assert len(lengths) == len(records) and all(150 <= n <= 600 for n in lengths), lengths


@pytest.mark.parametrize("extra, systems", [
    ([], ["pagedkv", "pagedkv prompt lookup", "HF generate", "HF prompt lookup"]),
    (["--batch", "2", "--no-hf"], ["pagedkv", "pagedkv prompt lookup"]),
], ids=["batch1", "batch2"])
def test_prompt_lookup_small_run(tokenizer, tmp_path, capsys, extra, systems):
    result = bench_prompt_lookup.main(["--small", "--out", str(tmp_path), *extra])
    printed = capsys.readouterr().out
    assert result["equal"] and "PASS: pagedkv prompt-lookup tokens equal" in printed and "FAIL:" not in printed
    assert 0 < result["accepted"] <= result["proposed"] and result["rounds"] > 0
    rows = table_rows(tmp_path / "bench_prompt_lookup.md")
    assert [r[0] for r in rows] == systems
    by_name = {r[0]: r for r in rows}
    assert by_name["pagedkv prompt lookup"][7] == "3/3"  # prompts equal to pagedkv
    assert 0 < float(by_name["pagedkv prompt lookup"][5]) <= 1  # acceptance
    assert float(by_name["pagedkv prompt lookup"][6]) >= 1  # new tokens per round
    assert "goal: prompt lookup >= 2.0x pagedkv without speculation" in printed
    assert "goal: faster than HF's prompt lookup" in printed
    assert (tmp_path / "bench_prompt_lookup.png").stat().st_size > 0


def test_verify_step_small_run(tmp_path, capsys):
    bench_verify_step.main(["--small", "--out", str(tmp_path), "--repeats", "2"])
    printed = capsys.readouterr().out
    rows = table_rows(tmp_path / "bench_verify_step.md")
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [
        (b, k, k + 1) for b in (1, 8, 32) for k in range(1, 9)]
    for row in rows:  # CPU: no graph decode step; the ratio is over the eager one
        verify, eager = float(row[3]), float(row[5])
        assert verify > 0 and eager > 0 and row[4] == row[6] == "n/a"
        assert float(row[7]) == pytest.approx(verify / eager, rel=0.02)
    assert "goal: k+1 = 5 at batch 1 <= 1.1x the eager (CPU: no graphs) decode step" in printed
    assert (tmp_path / "bench_verify_step.png").stat().st_size > 0
