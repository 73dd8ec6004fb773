"""The benchmark package's shape: imports point one way, and no peer stand-in ships inside slipstream."""

from __future__ import annotations

import ast
from pathlib import Path

from benchmarks.peers.standin import STANDINS

BENCH = Path(__file__).resolve().parents[2] / "slipstream" / "bench"


def _module_name(path: Path) -> str:
    parts = path.relative_to(BENCH.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """slipstream.bench modules `path` imports anywhere in it (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from pkg import mod` imports the module pkg.mod when it is one
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_bench_imports_have_no_cycle():
    files = {_module_name(p): p for p in BENCH.rglob("*.py")}
    graph = {name: _imports(path, set(files)) - {name} for name, path in files.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, name, dep])
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    # the peer adapters depend on the settings, never on the runner that calls them
    for name in graph:
        if name.startswith("benchmarks.peers"):
            assert "slipstream.bench.matrix" not in graph[name] and "slipstream.bench.suite" not in graph[name], name


def test_no_standin_package_inside_slipstream():
    # `pip install .` ships slipstream/ only: a directory named like a real package there would be one.
    root = BENCH.parent
    shadowing = [p for p in root.rglob("*") if p.is_dir() and p.name in STANDINS]
    assert shadowing == []
