"""pagedkv's build backend: scikit-build-core, after a check that the build can see torch.

The extension is compiled against torch's headers and loads only with that same torch, so it must
be built in the environment that will import it. pip builds in an isolated environment by default,
one that sees neither the installed torch nor (pagedkv does not list torch as a build requirement)
a second copy of it: there the build stops at once, with the command that works, instead of
compiling for minutes against a torch that is not the one that will load it.
"""

from __future__ import annotations

import importlib.util

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F403  (the hooks this module leaves as they are)

FIX = """
pagedkv: torch cannot be imported in this build environment, so the build stops here.

pagedkv's extension is compiled against the torch that will import it. pip builds in a separate,
isolated environment by default, which does not see your torch. Build in your environment instead:

    pip install torch scikit-build-core pybind11 cmake ninja   # those not installed yet
    pip install --no-build-isolation .                         # -e . for development; -v shows the build

Faster builds: PAGEDKV_CUDA_ARCHS=90 (only your GPU's architecture) or PAGEDKV_CUDA=OFF (CPU only).
"""


def _check_torch() -> None:
    # Only the compiling hooks check: metadata (prepare_metadata_*, which pip asks for first) and
    # the sdist need no torch, so resolvers and `python -m build --sdist` work anywhere.
    if importlib.util.find_spec("torch") is None:  # found without importing it (seconds)
        raise SystemExit(FIX)  # the message alone, no traceback: pip shows the hook's output


def build_wheel(wheel_directory: str, config_settings: dict[str, str | list[str]] | None = None,
                metadata_directory: str | None = None) -> str:
    _check_torch()
    return _scikit_build.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory: str, config_settings: dict[str, str | list[str]] | None = None,
                   metadata_directory: str | None = None) -> str:
    _check_torch()
    return _scikit_build.build_editable(wheel_directory, config_settings, metadata_directory)
