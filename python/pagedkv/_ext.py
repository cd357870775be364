"""Loads the compiled core ``pagedkv._C`` once and explains how to rebuild it when it cannot."""

from __future__ import annotations

import importlib
import pathlib

import torch  # noqa: F401  (the extension links against libtorch: load torch first)

_REBUILD = (
    "Rebuild it from the repository root with:\n"
    "    pip install --no-build-isolation -e .\n"
    "(the build uses the torch that is installed; a build made against another torch, Python or "
    "machine will not load)."
)


def load_extension():
    try:
        return importlib.import_module("pagedkv._C")
    except ImportError as err:
        here = pathlib.Path(__file__).resolve().parent
        found = sorted(p.name for p in here.glob("_C*")) or ["nothing"]
        raise ImportError(
            f"pagedkv: cannot load the compiled extension pagedkv._C ({err}).\n"
            f"Looked in {here} (found: {', '.join(found)}) and on sys.path.\n{_REBUILD}"
        ) from err


_C = load_extension()
