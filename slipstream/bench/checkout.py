"""The repository's `benchmarks/` directory: peer adapters and suite entries, which `pip install` does not ship.

The package never imports `benchmarks` by name (a test checks): `load` finds the directory explicitly and
imports it from that path, so that an installed slipstream says where the harness lives instead of failing on
an import or picking up an unrelated package of that name. Where it looks, in order:

  1. `--benchmarks DIR` (`use`; kept in SLIPSTREAM_BENCHMARKS, so the processes a suite row starts see it too)
  2. the checkout holding this package's source (an editable install or a run from the repository)
  3. ./benchmarks
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

ENV = "SLIPSTREAM_BENCHMARKS"
"""The benchmarks/ directory named by --benchmarks, for this process and the ones it starts."""
WHERE = "the peer adapters and suite entries live in a repository checkout's benchmarks/ (not installed with slipstream)"


class BenchmarksNotFound(ValueError):
    """No usable benchmarks/ directory."""


def use(directory: str | Path) -> None:
    """Take benchmarks/ from `directory` (`--benchmarks DIR`), here and in the processes started from here."""
    os.environ[ENV] = str(Path(directory).expanduser().resolve())


def find() -> Path:
    """The benchmarks/ directory to load, or BenchmarksNotFound saying where it was looked for."""
    if os.environ.get(ENV):
        named = Path(os.environ[ENV])
        if not (named / "__init__.py").is_file():
            raise BenchmarksNotFound(f"--benchmarks {named}: no benchmarks package there (__init__.py); {WHERE}")
        return named
    candidates = [Path(__file__).resolve().parents[2] / "benchmarks", Path.cwd().resolve() / "benchmarks"]
    for directory in candidates:
        if (directory / "__init__.py").is_file():
            return directory
    raise BenchmarksNotFound(f"{WHERE}: none at {' or '.join(map(str, candidates))}; pass --benchmarks DIR")


def load(module: str) -> ModuleType:
    """`benchmarks.<module>` ("peers", "peers.trl_adapter", "suite_entries") from the directory `find` names."""
    directory = find()
    package = sys.modules.get("benchmarks")
    if package is None:
        spec = importlib.util.spec_from_file_location(
            "benchmarks", directory / "__init__.py", submodule_search_locations=[str(directory)]
        )
        assert spec is not None and spec.loader is not None
        package = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = package  # its modules import each other as benchmarks.<name>
        spec.loader.exec_module(package)
    elif [Path(p).resolve() for p in package.__path__] != [directory]:
        raise BenchmarksNotFound(f"a different benchmarks package is already imported ({list(package.__path__)}); "
                                 f"wanted {directory}")  # fmt: skip
    return importlib.import_module(f"benchmarks.{module}")
