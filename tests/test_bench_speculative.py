"""Issue 34's benchmarks in their --small modes (CPU): bench_prompt_lookup.py on the real SmolLM2
(a row per system, pagedkv's prompt-lookup tokens equal to its greedy tokens, proposals counted and
some accepted), its prompt set as the issue asks (>= 20 input-grounded prompts of 150-600 tokens
once chat-formatted), its draft mode (--draft-layers: assistant_model rows, pagedkv's and HF's,
no FAIL line) and the layer-truncated draft it builds (truncated_draft.py: layer count, weights on
the target's tensors, HF's greedy tokens of the same truncated model), and bench_verify_step.py
(a row per batch and k, the goal line printed)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_prompt_lookup  # noqa: E402
import bench_verify_step  # noqa: E402
import truncated_draft  # noqa: E402

import pagedkv  # noqa: E402
from models import tiny_model  # noqa: E402
from pagedkv.runtime.model import PREPARED_ATTR  # noqa: E402


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
    (["--batch", "2", "--no-hf", "--also-k", "4", "--unbranched"],
     ["pagedkv", "pagedkv prompt lookup", "pagedkv prompt lookup (k 4)", "pagedkv prompt lookup, unbranched rounds"]),
], ids=["batch1", "batch2"])
def test_prompt_lookup_small_run(tokenizer, tmp_path, capsys, extra, systems):
    result = bench_prompt_lookup.main(["--small", "--out", str(tmp_path), *extra])
    printed = capsys.readouterr().out
    assert result["equal"] and "FAIL:" not in printed
    assert all(f"PASS: {name} tokens equal" in printed for name in systems if name.startswith("pagedkv prompt lookup"))
    assert 0 < result["accepted"] <= result["proposed"] and result["rounds"] > 0
    rows = table_rows(tmp_path / "bench_prompt_lookup.md")
    assert [r[0] for r in rows] == systems
    by_name = {r[0]: r for r in rows}
    assert by_name["pagedkv prompt lookup"][8] == "3/3"  # prompts equal to pagedkv
    assert float(by_name["pagedkv prompt lookup"][7]) > 0 and float(by_name["pagedkv"][7]) > 0  # ms a round / step
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
    for row in rows:  # CPU: no graph steps; the ratio is eager over eager
        verify, eager = float(row[3]), float(row[6])
        assert verify > 0 and eager > 0 and row[4] == row[5] == row[7] == "n/a"
        assert float(row[8]) == pytest.approx(verify / eager, rel=0.02)
    assert "goal: k+1 = 5 at batch 1 <= 1.1x the eager (CPU: no graphs) decode step" in printed
    assert (tmp_path / "bench_verify_step.png").stat().st_size > 0


@pytest.mark.parametrize("extra, systems", [
    ([], ["pagedkv", "pagedkv assistant_model", "HF generate", "HF assistant_model"]),
    (["--batch", "2", "--no-hf"], ["pagedkv", "pagedkv assistant_model"]),
], ids=["batch1", "batch2"])
def test_draft_model_small_run(tokenizer, tmp_path, capsys, extra, systems):
    result = bench_prompt_lookup.main(["--small", "--draft-layers", "2", "--out", str(tmp_path), *extra])
    printed = capsys.readouterr().out
    assert result["equal"] and "PASS: pagedkv assistant_model tokens equal" in printed and "FAIL" not in printed
    assert 0 <= result["accepted"] <= result["proposed"] and result["proposed"] > 0 and result["rounds"] > 0
    rows = table_rows(tmp_path / "bench_prompt_lookup_draft.md")
    assert [r[0] for r in rows] == systems
    ours = {r[0]: r for r in rows}["pagedkv assistant_model"]
    assert ours[8] == "3/3" and 0 <= float(ours[5]) <= 1 and float(ours[6]) >= 1 and float(ours[7]) > 0
    assert "first 2 of 30 layers" in (tmp_path / "bench_prompt_lookup_draft.md").read_text()
    assert "draft: acceptance" in printed and "goal: prompt lookup" not in printed
    assert (tmp_path / "bench_prompt_lookup_draft.png").stat().st_size > 0


@pytest.mark.parametrize("name", ["llama", "qwen3_tied"])
def test_truncated_draft(name):
    target = tiny_model(name)
    target.config.num_hidden_layers = 3  # a third layer, so that a draft of 2 drops one
    if isinstance(getattr(target.config, "layer_types", None), list):
        target.config.layer_types = target.config.layer_types + target.config.layer_types[-1:]
    target.model.layers.append(type(target.model.layers[1])(target.config, 2).eval())
    draft = truncated_draft.truncated_draft(target, 2)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    assert target.config.num_hidden_layers == 3 and len(target.model.layers) == 3  # the target unchanged
    # The draft's weights are the target's first layers' tensors (not copies), in new Parameter objects.
    own = dict(target.named_parameters())
    for key, p in draft.named_parameters():
        assert p is not own[key] and p.data_ptr() == own[key].data_ptr(), key
    assert set(dict(draft.named_parameters())) == {k for k in own if ".layers.2." not in k}
    # Its greedy tokens: HF's on the same truncated model built from a config and a state dict.
    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = 2
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:2]
    reference = type(target)(config).eval()
    reference.load_state_dict({k: v for k, v in target.state_dict().items() if ".layers.2." not in k})
    ids = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = reference.generate(ids, **greedy)
    assert torch.equal(draft.generate(ids, **greedy), expected)
    assert torch.equal(pagedkv.generate(draft, ids, **greedy), expected)
    # As assistant_model its greedy assisted tokens are the target's (both models prepared by pagedkv),
    # and preparing one leaves the other's weights alone: each is prepared once, not once a call.
    assert torch.equal(pagedkv.generate(target, ids, assistant_model=draft, num_assistant_tokens=3, **greedy),
                       pagedkv.generate(target, ids, **greedy))
    states = getattr(target, PREPARED_ATTR), getattr(draft, PREPARED_ATTR)
    pagedkv.generate(target, ids, assistant_model=draft, num_assistant_tokens=3, **greedy)
    assert (getattr(target, PREPARED_ATTR), getattr(draft, PREPARED_ATTR)) == states
    with pytest.raises(ValueError, match="allowed: 1..2"):
        truncated_draft.truncated_draft(target, 3)


def test_llm_prompt_lookup_small_run(tokenizer, tmp_path):
    """bench_llm_prompt_lookup.py --small: a row per engine and HF's, the speculating engines'
    tokens equal to the plain engine's (fp32), proposals made and some accepted."""
    import bench_llm_prompt_lookup

    result = bench_llm_prompt_lookup.main(["--small", "--out", str(tmp_path)])
    assert result["equal"]
    names = [row[0] for row in table_rows(tmp_path / "bench_llm_prompt_lookup.md")]
    assert names == [bench_llm_prompt_lookup.PLAIN, bench_llm_prompt_lookup.GRAPHS, bench_llm_prompt_lookup.EVERY_STEP,
                     bench_llm_prompt_lookup.EAGER, bench_llm_prompt_lookup.HF]
    for stats in result["stats"].values():
        assert 0 < stats.accepted <= stats.proposed
    assert (tmp_path / "bench_llm_prompt_lookup.png").exists()
