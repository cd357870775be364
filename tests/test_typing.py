"""pagedkv is typed for its users: py.typed ships in the package, the public API has return
annotations, and a type checker (mypy, from the `test` extra) reads a user's script
(typing_check/user_script.py) with the types its assert_type lines expect. A planted type error must
fail the same run, so the check is known to work. One mypy run serves every test; its cache
(.pytest_cache) makes later runs take seconds (the first follows torch's and transformers' types)."""

from __future__ import annotations

import functools
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import pagedkv

HERE = pathlib.Path(__file__).resolve().parent
USER_SCRIPT = HERE / "typing_check" / "user_script.py"
# Where `import pagedkv` finds the package: the source tree (editable install) or site-packages.
PACKAGE_ROOT = pathlib.Path(pagedkv.__file__).resolve().parents[1]

PLANTED = '''
import torch
import pagedkv
from transformers import LlamaForCausalLM

model = LlamaForCausalLM.from_pretrained("a/local/folder")
tokens: list[int] = pagedkv.generate(model, torch.tensor([[1, 2]]))  # planted: a Tensor, not a list
'''


MYPY_TIMEOUT_S = 900


@functools.lru_cache(maxsize=None)
def mypy_run(tmp: pathlib.Path, cache: str) -> tuple[int | None, str]:
    """mypy over the user script, the planted error and a reveal_type of every public name,
    as a user's checker sees them: pagedkv as an installed package (PEP 561: only with its
    py.typed), its errors (and torch's, transformers') not reported, only the scripts'.
    Returns mypy's exit status (0 clean, 1 errors found, 2 mypy itself failed, negative: killed
    by that signal, None: ran past MYPY_TIMEOUT_S) and what it printed."""
    (tmp / "planted.py").write_text(PLANTED)
    (tmp / "surface.py").write_text("import pagedkv\n" + "".join(
        f"reveal_type(pagedkv.{name})\n" for name in pagedkv.__all__))
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mypy", "--cache-dir", cache, "--hide-error-context",
             "--no-color-output", "--show-error-codes", "--python-executable", sys.executable,
             str(USER_SCRIPT), str(tmp / "planted.py"), str(tmp / "surface.py")],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=MYPY_TIMEOUT_S)
    except subprocess.TimeoutExpired as timeout:
        printed = timeout.stdout or ""
        return None, printed.decode() if isinstance(printed, bytes) else printed
    return proc.returncode, proc.stdout + proc.stderr


def tail(output: str, lines: int = 25) -> str:
    """The end of mypy's output, where a crash's exception or a write error is."""
    return "\n".join(output.splitlines()[-lines:]) or "(nothing)"


@pytest.fixture(scope="module")
def mypy_output(tmp_path_factory, request) -> str:
    pytest.importorskip("mypy", reason="mypy comes with the test extra: pip install -e '.[test]'")
    # pytest's cache keeps mypy's between runs; with -p no:cacheprovider (gpu_check.sh) a fresh one.
    config_cache = getattr(request.config, "cache", None)
    cache = config_cache.mkdir("mypy") if config_cache is not None else tmp_path_factory.mktemp("mypy-cache")
    code, output = mypy_run(tmp_path_factory.mktemp("typing"), str(cache))
    if code in (0, 1):
        return output
    # mypy's incremental mode can crash on a cache written for older sources, and its cache writes
    # (~250 MB from cold) fail on a full disk: once more with no cache at all (mypy reads
    # os.devnull as "none"), so that only a failure of mypy itself fails the check.
    first_code, first_output = code, output
    code, output = mypy_run(tmp_path_factory.mktemp("typing-nocache"), os.devnull)
    assert code in (0, 1), (
        f"mypy did not run: exit {code} with no cache, exit {first_code} with the cache {cache} "
        f"(None: ran past {MYPY_TIMEOUT_S} s; negative: killed by that signal).\n"
        f"Its last lines with no cache:\n{tail(output)}\nwith the cache:\n{tail(first_output)}")
    return output


def errors_in(output: str, file: str) -> list[str]:
    return [line for line in output.splitlines() if re.match(rf".*{file}:\d+: error", line)]


def test_py_typed_ships_in_the_package():
    # scikit-build-core's wheel.packages copies the whole folder, py.typed included.
    assert (pathlib.Path(pagedkv.__file__).parent / "py.typed").is_file()


def test_user_script_type_checks(mypy_output):
    assert errors_in(mypy_output, "user_script.py") == [], mypy_output


def test_planted_type_error_fails_the_check(mypy_output):
    errors = errors_in(mypy_output, "planted.py")
    assert len(errors) == 1 and ":7: error" in errors[0] and "Tensor" in errors[0], mypy_output


def test_public_names_are_not_any(mypy_output):
    revealed = re.findall(r'surface\.py:(\d+): note: Revealed type is "(.*)"', mypy_output)
    assert len(revealed) == len(pagedkv.__all__), mypy_output
    for line, kind in revealed:
        name = pagedkv.__all__[int(line) - 2]
        assert kind != "Any" and "-> Any" not in kind, f"pagedkv.{name} reads as {kind}"


def _public_functions():
    """Every public function of pagedkv and every public method/property of its public classes
    (those defined in pagedkv, their pagedkv bases included), as (name, function)."""
    for name in pagedkv.__all__:
        obj = getattr(pagedkv, name)
        if inspect.isclass(obj):
            for cls in obj.__mro__:
                if not cls.__module__.startswith("pagedkv") or cls.__module__ == "pagedkv._C":
                    continue
                for attr, member in vars(cls).items():
                    if attr.startswith("_") and attr != "__init__":
                        continue
                    member = member.fget if isinstance(member, property) else member
                    member = getattr(member, "__func__", member)  # classmethod, staticmethod
                    if inspect.isfunction(member):
                        yield f"{name}.{attr}", member
        elif inspect.isfunction(obj):
            yield name, obj


PUBLIC = dict(_public_functions())


def test_the_walk_sees_the_api():
    assert {"generate", "patch", "LLM.generate", "LLM.__init__", "KVCache.num_free_blocks",
            "CompletionOutput.text"} <= PUBLIC.keys()


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_api_has_return_annotations(name):
    assert "return" in PUBLIC[name].__annotations__, f"pagedkv.{name} has no return annotation"
