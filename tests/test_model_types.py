"""docs/model_types.md (every causal-LM type of transformers and how pagedkv runs it) is what
`python -m pagedkv.tools.model_types` writes for the installed transformers, when the file was
written for this version; its paths follow registry's lists whatever the version."""

from __future__ import annotations

import pathlib
import re

import pytest
import transformers

from pagedkv.models import registry
from pagedkv.tools import model_types

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "model_types.md"


def rows() -> dict[str, tuple[str, str]]:
    found = re.findall(r"^\| (\S+) \| (native|fallback|refused) \| (.*) \|$", DOC.read_text(), re.M)
    return {t: (path, note) for t, path, note in found}


def test_the_doc_is_the_tool_s_output_for_its_transformers():
    written_for = re.search(r"causal-LM model type of transformers (\S+) ", DOC.read_text()).group(1)
    if written_for != transformers.__version__:
        pytest.skip(f"docs/model_types.md is of transformers {written_for}, this is {transformers.__version__}")
    assert DOC.read_text() == model_types.table(), \
        "docs/model_types.md is stale: python -m pagedkv.tools.model_types > docs/model_types.md"


def test_each_listed_type_has_its_path():
    table = rows()
    assert len(table) > 100
    for model_type, (path, note) in table.items():
        if model_type in registry.NATIVE_MODEL_TYPES:
            assert path == "native", model_type
        elif model_type in registry.FALLBACK_MODEL_TYPES:
            assert path == "fallback", model_type
        else:
            assert path == "refused" and note, model_type
