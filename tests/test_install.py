"""Installing pagedkv from a checkout: pip's default (isolated) build stops at once with the command
that works, `python -m build --sdist` needs no torch, and the metadata is complete, from one
version. These run pip and the build backend for real; none compiles (see test_install_build.py)."""

from __future__ import annotations

import contextlib
import email
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib

import pytest

import pagedkv

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIX = "pip install --no-build-isolation ."
# What a checkout holds that a build must not read or write: outputs, environments, caches.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "build", "results", "__pycache__", "*.so",
                                   ".pytest_cache", ".hypothesis", "*.egg-info", "dist")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def copy_of_source(tmp_path: pathlib.Path) -> pathlib.Path:
    """The checkout without its build outputs: a build there cannot touch the shared tree."""
    source = tmp_path / "pagedkv-src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    return source


def backend(source: pathlib.Path, code: str) -> subprocess.CompletedProcess:
    """Runs `code` with the project's build backend imported as `backend`, in `source`, the way a
    build frontend does (backend-path on sys.path, the working directory at the project root)."""
    system = pyproject()["build-system"]
    paths = [str(source / p) for p in system.get("backend-path", [])]
    script = (f"import sys; sys.path[:0] = {paths!r}; import importlib; "
              f"backend = importlib.import_module({system['build-backend']!r})\n{code}")
    return subprocess.run([sys.executable, "-c", script], cwd=source, capture_output=True,
                          text=True, timeout=120)


def test_build_requirements_leave_torch_to_the_environment():
    # torch here would make pip's isolated build fetch a second torch and compile against it.
    requires = pyproject()["build-system"]["requires"]
    assert not [r for r in requires if re.split(r"[\s<>=!~\[;]", r)[0] == "torch"], requires


def test_backend_without_torch_stops_before_building_naming_the_fix(tmp_path):
    # What pip's isolated environment looks like to the backend; runs without pip or an index.
    done = backend(ROOT, "import importlib.util; find = importlib.util.find_spec;"
                         "importlib.util.find_spec = lambda n, *a: None if n == 'torch' else find(n, *a);"
                         f"backend.build_wheel({str(tmp_path)!r})")
    assert done.returncode == 1 and FIX in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


def test_sdist_needs_no_torch_and_holds_the_source(tmp_path):
    source = copy_of_source(tmp_path)
    (source / "build").mkdir()  # a stale build folder must stay out of the tarball
    (source / "build" / "junk.o").write_text("x")
    done = backend(source, f"print(backend.get_requires_for_build_sdist());"
                           f"print(backend.build_sdist({str(tmp_path)!r}))")
    assert done.returncode == 0, done.stderr
    requires, name = done.stdout.strip().splitlines()[-2:]
    assert "torch" not in requires  # what the sdist's build adds to build-system.requires
    test_build_requirements_leave_torch_to_the_environment()
    with tarfile.open(tmp_path / name) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"LICENSE", "pyproject.toml", "CMakeLists.txt", "python/pagedkv/__init__.py",
            "csrc/bindings.cpp"} <= names
    assert {p for p in pyproject()["build-system"].get("backend-path", [])} <= {n.split("/")[0] for n in names}
    assert not [n for n in names if n.startswith("build/")]


def test_metadata_is_complete_and_has_one_version(tmp_path):
    project = pyproject()["project"]
    assert "version" not in project and "version" in project.get("dynamic", [])  # __init__.py's
    done = backend(ROOT, f"print(backend.prepare_metadata_for_build_wheel({str(tmp_path)!r}))")
    assert done.returncode == 0, done.stderr
    dist_info = tmp_path / done.stdout.strip().splitlines()[-1]
    meta = email.message_from_string((dist_info / "METADATA").read_text())
    assert meta["Name"] == "pagedkv" and meta["Version"] == pagedkv.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    assert "pagedkv developers" in (meta["Author"] or "") + (meta["Author-email"] or "")
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3" in classifiers
    assert any(c.startswith("Development Status ::") for c in classifiers)
    assert "transformers" in meta["Keywords"]
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in license_text and len(license_text) > 11000


def test_wheels_build_outside_the_source_tree_editable_installs_incrementally():
    # scikit-build-core uses a temporary folder unless build-dir is set: set only for -e.
    settings = pyproject()["tool"]["scikit-build"]
    assert "build-dir" not in settings
    editable = [o for o in settings.get("overrides", []) if o.get("if", {}).get("state") == "editable"]
    assert [o.get("build-dir") for o in editable] == ["build/{wheel_tag}"]


def pip_reaches_its_index() -> bool:
    try:
        return subprocess.run([sys.executable, "-m", "pip", "index", "versions", "scikit-build-core"],
                              capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def venv_seeing_this_environment(path: pathlib.Path) -> pathlib.Path:
    """A fresh virtual environment that sees this one's packages (torch, pip) as it would see
    system-wide ones (--system-site-packages): what pip installs goes into the new one only."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", path],
                   check=True, timeout=60)
    python = path / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(site, "outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def kill_session(session: int) -> None:
    """Kills every process of a session (ninja gives each compiler its own process group)."""
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # after ")": state, ppid, pgrp, session
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


def test_isolated_pip_install_stops_at_once_naming_the_fix(tmp_path):
    if not pip_reaches_its_index():
        pytest.skip("pip cannot reach its package index: the isolated build env needs "
                    "scikit-build-core and pybind11 from it")
    source = copy_of_source(tmp_path)
    python = venv_seeing_this_environment(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_NO_BUILD_ISOLATION")}
    env["PAGEDKV_CUDA"] = "OFF"  # the CPU-only build, should the build ever start
    start = time.monotonic()
    # Its own session: a timeout stops pip and the compilers it started.
    pip = subprocess.Popen([python, "-m", "pip", "install", "--no-cache-dir", str(source)],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        out, _ = pip.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_session(pip.pid)
        pip.communicate()
        pytest.fail("pip install . (isolated) still ran after 120 s: it should stop in seconds")
    took = time.monotonic() - start
    assert pip.returncode != 0, f"installed with isolation: check it loads with this torch\n{out}"
    assert FIX in out, out
    assert took < 60, f"took {took:.0f} s to fail"
    assert not (source / "build").exists()
    print(f"isolated pip install failed as it should in {took:.1f} s")
