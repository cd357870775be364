"""The build itself: CMake says what it compiles and how to make it faster, stops with the fix when
it cannot import torch, and (slow, PAGEDKV_SLOW_TESTS=1) a CPU-only wheel builds outside the source
tree and imports with the torch it records."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile

import pytest
import torch

import pagedkv
from test_install import FIX, ROOT, copy_of_source

SCRIPTS = pathlib.Path(sysconfig.get_paths()["scripts"])
CMAKE = shutil.which("cmake", path=f"{SCRIPTS}{os.pathsep}{os.environ.get('PATH', '')}")
slow = pytest.mark.skipif(not os.environ.get("PAGEDKV_SLOW_TESTS"),
                          reason="compiles pagedkv (minutes): set PAGEDKV_SLOW_TESTS=1")


def configure(tmp_path: pathlib.Path, python: str, **defines: str) -> subprocess.CompletedProcess:
    """CMake's configure step alone (seconds: nothing is compiled)."""
    import pybind11

    args = [CMAKE, "-S", ROOT, "-B", tmp_path / "cmake", f"-DPython_EXECUTABLE={python}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"]
    args += [f"-D{k}={v}" for k, v in defines.items()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_CUDA")}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def test_configure_says_what_it_builds(tmp_path):
    done = configure(tmp_path, sys.executable, PAGEDKV_CUDA="OFF")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"pagedkv: building CPU only (PAGEDKV_CUDA=OFF, torch {torch.__version__})" in done.stdout
    assert "pagedkv: compiling" in done.stdout and "C++ files" in done.stdout
    built = (tmp_path / "cmake" / "generated" / "_build_config.py").read_text()
    assert f'TORCH_VERSION = "{torch.__version__}"' in built


@pytest.mark.skipif(not torch.version.cuda or not (shutil.which("nvcc") or
                                                   pathlib.Path("/usr/local/cuda/bin/nvcc").exists()),
                    reason="needs nvcc and a CUDA build of torch (no GPU needed)")
def test_configure_with_cuda_says_how_to_build_faster(tmp_path):
    done = configure(tmp_path, sys.executable, PAGEDKV_CUDA="ON", PAGEDKV_CUDA_ARCHS="80;90")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pagedkv: building CPU + CUDA (archs 80;90" in done.stdout
    assert "2 GPU architecture(s)" in done.stdout
    assert "PAGEDKV_CUDA_ARCHS=90" in done.stdout and "PAGEDKV_CUDA=OFF" in done.stdout


def test_configure_without_torch_names_the_fix(tmp_path):
    venv = tmp_path / "no-torch"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    done = configure(tmp_path, str(venv / "bin" / "python"), PAGEDKV_CUDA="OFF")
    assert done.returncode != 0
    assert "cannot import torch" in done.stderr and FIX in " ".join(done.stderr.split()), done.stderr


@slow
def test_cpu_wheel_builds_out_of_tree_and_loads_with_its_torch(tmp_path):
    source = copy_of_source(tmp_path)
    env = {**os.environ, "PAGEDKV_CUDA": "OFF"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation",
                           "--no-deps", "--no-cache-dir", "-w", tmp_path / "dist", source],
                          capture_output=True, text=True, env=env, timeout=1800)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-10000:]
    print(f"CPU-only wheel built in {time.monotonic() - start:.0f} s")
    assert "pagedkv: building CPU only" in out and "pagedkv: compiling" in out  # pip -v shows them
    assert not (source / "build").exists()  # built in a temporary folder
    wheel, = (tmp_path / "dist").glob("pagedkv-*.whl")
    assert wheel.name.startswith(f"pagedkv-{pagedkv.__version__}-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "unpacked")
    assert "pagedkv/_build_config.py" in names and any(n.startswith("pagedkv/_C") for n in names)
    assert f"pagedkv-{pagedkv.__version__}.dist-info/licenses/LICENSE" in names
    # Import the wheel's copy (-S: not the editable install of this environment, whose finder
    # a .pth file installs), with this environment's torch on the path.
    path = os.pathsep.join([str(tmp_path / "unpacked"), *(p for p in sys.path if p.endswith("site-packages"))])
    check = ("import pagedkv, torch; assert pagedkv.__file__.startswith(%r), pagedkv.__file__; "
             "x = torch.randn(3, 8); w = torch.randn(8);"
             "torch.testing.assert_close(pagedkv.ops.rms_norm(x, w, 1e-6),"
             " x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w);"
             "print(pagedkv.build_info)") % str(tmp_path / "unpacked")
    loaded = subprocess.run([sys.executable, "-S", "-c", check], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": path}, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith("CPU only (PAGEDKV_CUDA=OFF, torch")
