"""The package's import map: every import between two subpackages of slipstream/ points down the layer
order below, so the map has no circle. Imports inside functions count as much as those at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import slipstream.cli

PACKAGE = Path(slipstream.cli.__file__).parent

# Bottom to top. A subpackage (or top-level module) imports only from layers below its own; two
# subpackages of one layer import nothing from each other.
LAYERS: list[tuple[str, ...]] = [
    ("ops", "logging"),  # foundations: kernels (and their launch settings), metric sinks
    ("config",),  # the typed config tree, which checks kernel launch settings with ops/decode_launch.py
    ("models",),  # native model code and HF / GGUF I/O, over the kernels
    ("batching", "perf"),  # typed records and packing; FLOPs and timers, over the model config
    ("algo", "rewards", "checkpoint"),  # pure losses / advantages; reward functions and runner; checkpoints
    ("data", "engine", "rollout"),  # prompt sources (their answers in the rewards' formats); train and rollout engines
    ("eval",),  # eval sets and the evaluator, over the data sources and a rollout engine
    ("controller",),  # the run: set-up, stages, loops, the trainer (which runs evals)
    ("evaluate", "report"),  # the `slipstream eval` and `slipstream report` commands
    ("bench",),  # the benchmarks a user runs (train-step, rollout, matrix, suite)
    ("cli",),  # the command line, over everything
]


def _subpackage(module: str) -> str | None:
    """`slipstream.controller.trainer` -> `controller`; None for modules outside the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "slipstream" and len(parts) > 1 else None


def import_edges(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) subpackage pairs -> the `file:line`s of those imports."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        source = _subpackage(".".join(parts))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolved against this module's package
                    base = parts[: len(parts) - node.level + (rel.name == "__init__")]
                    node_module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    node_module = node.module or ""
                # `from slipstream import controller` names the subpackage in the alias
                modules = [f"{node_module}.{a.name}" for a in node.names] if node_module == "slipstream" else [node_module]
            else:
                continue
            for module in modules:
                target = _subpackage(module)
                if target is not None and source is not None and target != source:
                    edges.setdefault((source, target), []).append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return edges


def _layer_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _cycles(edges) -> list[list[str]]:
    """The circles of the subpackage graph (one per strongly connected set of more than one node)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_subpackage_has_a_layer():
    names = {p.stem for p in PACKAGE.iterdir() if (p.suffix == ".py" or p.is_dir()) and not p.name.startswith("__")}
    names -= {"__init__"}
    layer_of = _layer_of()
    assert sorted(names - set(layer_of)) == [], "place the new subpackage in LAYERS"
    assert sorted(set(layer_of) - names) == [], "LAYERS names a subpackage that is gone"


def test_the_import_map_has_no_circle():
    assert _cycles(import_edges()) == []


def test_every_import_points_down_the_layers():
    layer_of = _layer_of()
    upward = [
        f"{a} -> {b} ({', '.join(where)})"
        for (a, b), where in sorted(import_edges().items())
        if layer_of.get(b, len(LAYERS)) >= layer_of.get(a, -1)
    ]
    assert upward == []


def test_the_checks_see_function_level_and_upward_imports(tmp_path):
    """The scanner itself: an import inside a function is an edge, and a circle is found."""
    pkg = tmp_path / "slipstream"
    (pkg / "data").mkdir(parents=True)
    (pkg / "rewards").mkdir()
    (pkg / "data" / "tasks.py").write_text("from slipstream.rewards.functions import f\n")
    (pkg / "rewards" / "rg.py").write_text("def g():\n    from slipstream.data import tasks\n")
    edges = import_edges(pkg)
    assert set(edges) == {("data", "rewards"), ("rewards", "data")}
    assert edges[("rewards", "data")] == ["slipstream/rewards/rg.py:2"]
    assert _cycles(edges) == [["data", "rewards"]]
