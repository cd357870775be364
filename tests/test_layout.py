"""The package's shape: layers import only downward, no module imports itself back through
others, and no Python file grows past ~400 lines (read with ast; nothing is imported)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "pagedkv"
# Data flows top to bottom; a module may import its own subpackage and anything ranked lower.
# hf and engine share a rank: neither imports the other.
RANKS = {"_ext": 0, "ops": 1, "cache": 2, "layers": 2, "quant": 2, "models": 3, "runtime": 4, "hf": 5,
         "engine": 5, "tools": 6, "__init__": 7, "__main__": 7}
MAX_LINES = 400


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> set[str]:
    """Every pagedkv module `path` imports, at any depth of its code (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "pagedkv")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "pagedkv":
            # `from pagedkv import ops`: the module ops; `from pagedkv import generate`: pagedkv
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                where = PACKAGE.parent / sub.replace(".", "/")
                is_module = where.is_dir() or where.with_suffix(".py").exists()
                found.add(sub if is_module else node.module)
    return found


def top(module: str) -> str:
    """The subpackage (layer) a module belongs to: pagedkv.runtime.runner -> runtime."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


SOURCES = sorted(PACKAGE.rglob("*.py"))
GRAPH = {module_name(p): imports_of(p) for p in SOURCES}


def test_the_walk_sees_the_package():
    assert {"pagedkv.runtime.runner", "pagedkv.engine.llm", "pagedkv.hf.generate",
            "pagedkv.cache.kv_cache"} <= GRAPH.keys()
    assert "pagedkv.runtime.runner" in GRAPH["pagedkv.engine.llm"]  # the walk finds imports


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_upward_import(module):
    layer = top(module)
    assert layer in RANKS, f"{module}: a new subpackage; give it a rank in RANKS"
    upward = sorted(m for m in GRAPH[module] if top(m) != layer and RANKS[top(m)] >= RANKS[layer])
    assert not upward, f"{module} ({layer}, rank {RANKS[layer]}) imports {upward}, not below it"


def test_no_import_cycle():
    resolved = {m: {i for i in deps if i in GRAPH} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(resolved[module]):
            if dep == module:
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(resolved):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_files_stay_short(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines; split it by concept"


# One runtime: each of these happens in exactly one file of the package.
ONE_PLACE = {
    "CUDA graph capture": (("torch.cuda.graph(", "CUDAGraph()"), "runtime/graphs.py"),
    "step metadata built": ((".build_step(",), "cache/kv_cache.py"),
    "sampling": (("ops.sample(",), "runtime/sampler.py"),
}


@pytest.mark.parametrize("what", sorted(ONE_PLACE))
def test_one_place(what):
    needles, home = ONE_PLACE[what]
    where = sorted(str(p.relative_to(PACKAGE)) for p in SOURCES
                   if p.parent.name != "ops" and any(n in p.read_text() for n in needles))  # ops/ wraps
    assert where == [home], f"{what} happens in {where}; it belongs in {home} alone"
