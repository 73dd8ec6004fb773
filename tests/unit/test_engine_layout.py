"""The training backends' import rules, read from the source with ast (nothing is imported).

Pieces every backend needs live in slipstream/engine/base.py. A backend module may import
another backend's module only for the documented subclassing (FSDPEngine extends LocalEngine
and overrides its hooks), and never a private name from any module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "slipstream" / "engine"
BACKEND_MODULES = {
    "local": ["local.py"],
    "fsdp": ["fsdp.py"],
    "megatron": sorted(p.relative_to(ENGINE).as_posix() for p in (ENGINE / "megatron").glob("*.py")),
}
BACKEND_PACKAGES = {
    "local": "slipstream.engine.local",
    "fsdp": "slipstream.engine.fsdp",
    "megatron": "slipstream.engine.megatron",
}
ALLOWED_CROSS_IMPORTS = {("fsdp", "slipstream.engine.local"): {"LocalEngine"}}
"""(importing backend, imported module) -> names it may take: the documented subclassing only."""


def imports(source: str) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None for `import module`, line) of every import, nested ones too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
    return sorted(found, key=lambda item: item[2])


def owner(module: str) -> str | None:
    """The backend a module belongs to, or None for shared modules (base, distributed, optim, ...)."""
    for backend, package in BACKEND_PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return backend
    return None


def layout_violations(backend: str, source: str, filename: str) -> list[str]:
    bad = []
    for module, name, line in imports(source):
        where = f"{filename}:{line}"
        if name is not None and name.startswith("_") and module.startswith("slipstream"):
            bad.append(f"{where} imports private {module}.{name}")
        target = owner(module)
        if target is None or target == backend:
            continue
        if name is None or name not in ALLOWED_CROSS_IMPORTS.get((backend, module), set()):
            bad.append(f"{where} imports {module}{'' if name is None else '.' + name} from another backend")
    return bad


@pytest.mark.parametrize("backend,file", [(b, f) for b, files in BACKEND_MODULES.items() for f in files])
def test_backend_imports_only_shared_pieces(backend, file):
    assert layout_violations(backend, (ENGINE / file).read_text(), file) == []


def test_megatron_modules_are_all_checked():
    assert {"megatron/engine.py", "megatron/provider.py"} <= set(BACKEND_MODULES["megatron"])


def test_rules_catch_a_sibling_helper():
    """The check itself: megatron reaching into local's helpers (as it once did) is reported."""
    source = (
        "from slipstream.engine.local import _oom_advice, count_loss_tokens\n"
        "def f():\n    import slipstream.engine.fsdp\n"
        "from slipstream.engine.local import LocalEngine\n"
    )
    bad = layout_violations("megatron", source, "megatron/probe.py")
    assert bad == [
        "megatron/probe.py:1 imports private slipstream.engine.local._oom_advice",
        "megatron/probe.py:1 imports slipstream.engine.local._oom_advice from another backend",
        "megatron/probe.py:1 imports slipstream.engine.local.count_loss_tokens from another backend",
        "megatron/probe.py:3 imports slipstream.engine.fsdp from another backend",
        "megatron/probe.py:4 imports slipstream.engine.local.LocalEngine from another backend",
    ]
    # fsdp's subclassing of LocalEngine is the one allowed cross import; its helpers are not
    assert layout_violations("fsdp", "from slipstream.engine.local import LocalEngine\n", "fsdp.py") == []
    assert len(layout_violations("fsdp", "from slipstream.engine.local import make_norm\n", "fsdp.py")) == 1
