"""PAGEDKV_TEST_SHARD (tests/conftest.py), which scripts/gpu_sanitize.sh uses to spread the
kernel tests over parallel sanitizer processes: the shards of a selection are disjoint and
together are the whole selection, after -k; a bad value is refused."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parent
SELECTION = ["tests/test_rms_norm.py", "tests/test_activation.py", "-k", "float32 or bfloat16"]


def collect(*shards: str | None) -> list[tuple[int, list[str]]]:
    """(exit code, collected test ids) of one `pytest --collect-only` per shard value (None: no
    sharding), run side by side."""
    runs = []
    for shard in shards:
        env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_TEST_SHARD"}
        if shard is not None:
            env["PAGEDKV_TEST_SHARD"] = shard
        runs.append(subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q",
                                      "-p", "no:cacheprovider", *SELECTION], cwd=TESTS.parent, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    results = []
    for run in runs:
        out, _ = run.communicate(timeout=300)
        results.append((run.returncode, [line for line in out.splitlines() if "::" in line]))
    return results


def test_shards_partition_the_selection_and_bad_values_are_refused():
    (code, everything), *shards, (bad_index, _), (bad_text, _) = collect(None, "0/2", "1/2", "2/2", "a/b")
    assert code == 0 and len(everything) > 20
    # -k applied before sharding: no fp16 test in the selection (dtype ids by name, conftest.py)
    assert not any("-float16-" in t for t in everything) and any("-bfloat16-" in t for t in everything)
    assert all(code == 0 and ids for code, ids in shards)
    combined = [t for _, ids in shards for t in ids]
    assert sorted(combined) == sorted(everything)  # disjoint (no repeats) and complete
    assert abs(len(shards[0][1]) - len(shards[1][1])) <= 1
    assert bad_index != 0 and bad_text != 0
