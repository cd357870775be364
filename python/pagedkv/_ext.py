"""Loads the compiled core ``pagedkv._C`` once and explains how to rebuild it when it cannot."""

from __future__ import annotations

import importlib
import pathlib

import torch  # noqa: F401  (the extension links against libtorch: load torch first)

_REBUILD = (
    "Rebuild it against this torch, from the repository root:\n"
    "    pip install --no-build-isolation -e .     (development install; or . without -e)\n"
    "(the build uses the torch that is installed; a build made against another torch, Python or "
    "machine will not load)."
)


def built_for_torch() -> str | None:
    """The torch version ``pagedkv._C`` was compiled against (written by the build beside it),
    or None for a build that did not record it."""
    try:
        return importlib.import_module("pagedkv._build_config").TORCH_VERSION
    except ImportError:  # a build from before the record: loading _C is the check
        return None


def check_torch_version() -> None:
    # Checked before _C loads: with another torch it fails on a missing symbol or, worse, loads
    # and crashes later (torch's C++ ABI is not stable across versions).
    built, running = built_for_torch(), str(torch.__version__)
    if built is not None and built != running:
        raise ImportError(
            f"pagedkv: this build of pagedkv was built for torch {built}, but this is torch "
            f"{running}; its compiled extension loads only with the torch it was built for.\n"
            f"{_REBUILD}"
        )


def load_extension():
    check_torch_version()
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
