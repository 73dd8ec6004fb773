"""The benchmark harness's shape: imports point one way, the installed package holds no harness, and every
benchmark is defined once (its cells in one spec file under benchmarks/specs, which a suite entry runs)."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "slipstream"
BENCH = PACKAGE / "bench"
BENCHMARKS = REPO / "benchmarks"
LOADER = BENCH / "checkout.py"
"""The one module of the package that loads benchmarks/, by path."""


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Every module name `path` imports anywhere (function-level imports and importlib calls with a literal
    name included); `from pkg import x` counts as pkg and pkg.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def _graph(root: Path) -> dict[str, set[str]]:
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    return {name: {m for m in _imported(path) if m in files} - {name} for name, path in files.items()}


def _assert_no_cycle(graph: dict[str, set[str]]) -> None:
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


def test_bench_and_benchmarks_imports_have_no_cycle():
    _assert_no_cycle(_graph(BENCH))
    graph = _graph(BENCHMARKS)
    _assert_no_cycle(graph)
    # the peer adapters depend on the settings, never on the suite entries that run them
    for name in graph:
        if name.startswith("benchmarks.peers"):
            assert "benchmarks.suite_entries" not in graph[name], name


def test_the_package_imports_benchmarks_only_through_the_loader():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        names = {n for n in _imported(path) if n == "benchmarks" or n.startswith("benchmarks.")}
        if names and path != LOADER:
            offenders[str(path.relative_to(REPO))] = sorted(names)
    assert offenders == {}
    # the loader imports benchmarks/ from the directory it found, not from whatever sys.path holds
    source = LOADER.read_text()
    assert "spec_from_file_location" in source and "sys.path" not in source


def test_the_checker_sees_function_level_and_importlib_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import importlib\ndef f():\n    from benchmarks.peers import x\n"
                      "    importlib.import_module('benchmarks.suite_entries')\n")  # fmt: skip
    assert {"benchmarks.peers", "benchmarks.suite_entries"} <= _imported(sample)


def _installed_files() -> list[str]:
    """The files `pip wheel .` puts in the wheel: setuptools' package discovery with pyproject's settings."""
    import tomllib

    from setuptools import find_namespace_packages  # pyproject configuration discovers namespaces too

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_namespace_packages(str(REPO), include=config["include"])
    return [str(p.relative_to(REPO)) for pkg in packages for p in (REPO / pkg.replace(".", "/")).glob("*.py")]


def test_the_wheel_holds_no_harness():
    from benchmarks.peers.standin import STANDINS

    files = _installed_files()
    assert "slipstream/bench/cli.py" in files and "slipstream/bench/checkout.py" in files
    harness = [f for f in files if f.startswith("benchmarks/") or "/peers/" in f or "suite_entries" in f]
    assert harness == []
    # a directory named like a real package inside slipstream/ would shadow it once installed
    assert [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name in STANDINS] == []
    # no stand-in or peer runner: nothing in the package writes stand-ins or drives a peer framework
    for f in files:
        names = _imported(REPO / f)
        assert not {"trl", "verl", "ray"} & {n.split(".")[0] for n in names}, f


def test_without_a_checkout_peer_cells_are_explained_and_the_suite_says_where_entries_live(tmp_path, monkeypatch,
                                                                                          capsys):  # fmt: skip
    import sys

    from slipstream.bench import checkout, matrix, suite
    from slipstream.bench.spec import parse_spec

    monkeypatch.setattr(checkout, "find", lambda: (_ for _ in ()).throw(checkout.BenchmarksNotFound(checkout.WHERE)))
    spec = parse_spec({"workloads": ["tiny"], "frameworks": ["trl", "verl"], "backends": ["fsdp"], "device": "cpu"})
    for w, framework, backend in spec.cells():
        result = matrix.run_cell(spec, w, framework, backend)
        assert result["status"] == "not-available" and "benchmarks/" in result["reason"], result
    monkeypatch.delitem(sys.modules, "benchmarks", raising=False)
    args = type("Args", (), {"benchmarks": None, "list": True})()
    assert suite.run_suite_command(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "peer adapters and suite entries live in a repository checkout" in err


def test_an_explicit_benchmarks_dir_that_is_not_one_is_refused(tmp_path, monkeypatch):
    from slipstream.bench import checkout

    monkeypatch.setenv(checkout.ENV, "")  # restored (to unset) after the test
    checkout.use(tmp_path)
    with pytest.raises(checkout.BenchmarksNotFound, match="no benchmarks package there"):
        checkout.find()
    monkeypatch.delenv(checkout.ENV)
    assert checkout.find() == BENCHMARKS


# ---------------------------------------------------------------- each benchmark defined once

SPEC_FILES = sorted(p.name for p in (BENCHMARKS / "specs").glob("matrix_*.yaml"))


RUNS = ((False, 0), (False, 1), (True, 0))
"""(quick, GPUs) the entries' rows are built for: full size on a CPU machine and on a GPU one, CPU-sized."""


def _matrix_specs(entries, run: tuple[bool, int], monkeypatch) -> dict[str, dict]:
    """entry/row -> the matrix spec of every matrix row of every entry (read from the row's closure)."""
    from benchmarks import suite_entries

    quick, gpus = run
    monkeypatch.setattr(suite_entries, "gpu_count", lambda: gpus)
    out = {}
    for entry in entries.values():
        if quick and not entry.has_quick:
            continue
        for row in entry.rows(quick):
            cells = dict(zip(row.run.__code__.co_freevars, row.run.__closure__ or ()))
            if "spec" in cells and "label" in cells:  # _row's lambda: matrix_row(label, spec)
                out[f"{entry.name}/{row.name}"] = copy.deepcopy(cells["spec"].cell_contents)
    return out


def _marked(name: str):
    """spec_file, with `name`'s steps / repeats changed to a value no entry uses."""
    from benchmarks import suite_entries

    original = suite_entries.spec_file  # the test puts it back after each file

    def spec_file(requested: str) -> dict:
        spec = original(requested)
        if requested == name:
            if "rl_step" in spec:
                spec["rl_step"]["steps"] = 997
            else:
                spec["repeats"] = 997
        return spec

    return spec_file


def _cell(spec: dict):
    """What a one-cell spec measures, ignoring how its frameworks / backends lists are written."""
    from slipstream.bench.spec import parse_spec

    parsed = parse_spec(spec)
    (w, framework, backend), *_ = parsed.cells()
    if parsed.rl_step is not None:
        return ("rl-step", parsed.rl_step, parsed.settings, framework, backend)
    return ("train-step", w, parsed.settings, parsed.trl, parsed.verl, parsed.naive, framework, backend)


def test_every_spec_file_is_run_by_a_suite_entry_and_no_entry_copies_one(monkeypatch):
    from benchmarks import suite_entries
    from slipstream.bench import suite

    monkeypatch.chdir(REPO)  # rl-step recipes are relative to the repository root
    entries = suite._registry()
    before = {run: _matrix_specs(entries, run, monkeypatch) for run in RUNS}
    derived = set()
    original = suite_entries.spec_file
    for name in SPEC_FILES:
        monkeypatch.setattr(suite_entries, "spec_file", _marked(name))
        changed = {(run, key) for run in RUNS for key, spec in _matrix_specs(entries, run, monkeypatch).items()
                   if spec != before[run][key]}  # fmt: skip
        assert changed, f"benchmarks/specs/{name} is run by no suite entry (run it from one, or delete it)"
        derived |= changed
        monkeypatch.setattr(suite_entries, "spec_file", original)
    # a row that no spec file feeds must not measure a cell some spec file defines: that would be a copy
    file_cells = []
    for name in SPEC_FILES:
        spec = suite_entries.spec_file(name)
        for framework in spec["frameworks"]:
            for backend in spec["backends"]:
                for workload in spec.get("workloads", [None]):
                    one = {**spec, "frameworks": [framework], "backends": [backend]}
                    if workload is not None:
                        one["workloads"] = [workload]
                    try:
                        file_cells.append((name, _cell(one)))
                    except ValueError:  # a combination the matrix refuses (not a cell)
                        pass
    for run in RUNS:
        for key, spec in before[run].items():
            if (run, key) not in derived:
                cell = _cell(spec)
                copies = [name for name, c in file_cells if c == cell]
                assert copies == [], f"suite row {key} defines inline a cell of benchmarks/specs/{copies[0]}"
