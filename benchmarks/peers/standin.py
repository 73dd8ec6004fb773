"""Import-only stand-ins for packages verl imports at module load but the timed bench path never calls.

verl 0.9.1 imports `ray` (verl/protocol.py, single_controller/, checkpoint_engine/) and, through
checkpoint_engine -> workers/rollout (utils.py, replica.py), `uvicorn`, `fastapi` and `pydantic`,
although the path the bench times (verl's TrainingWorker driving its FSDP engine in one process)
calls none of them. Real Ray is far too large to carry to the GPU machine, and the web stack
(fastapi, starlette, pydantic, uvicorn) is not there either.

Nothing here is an installed package: `write_standin_site` writes one small package per name into
a temporary directory that only the verl subprocess has on its PYTHONPATH (after verl's site), and
each calls `install`, so that every name and every submodule resolves to a placeholder that raises
`StandInUsed` when called (or, used as a base class, when the subclass is instantiated): nothing
can silently run without the real package.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from pathlib import Path

STANDINS = ("ray", "uvicorn", "fastapi", "pydantic")
"""The packages the verl subprocess gets as stand-ins."""
_PACKAGE_INIT = '''"""Import-only stand-in for `{name}`, written by slipstream (benchmarks/peers/standin.py)."""

from benchmarks.peers.standin import install

__getattr__ = install(__name__, globals())
'''


class StandInUsed(RuntimeError):
    """A placeholder was used: the verl code path needs the real package after all."""


class Placeholder:
    """Stands for `<package>.<path>`: attribute look-ups nest (import-time references); use raises."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise StandInUsed(f"{self._path}(...) was called, but {self._path.split('.')[0]!r} is slipstream's "
                          "import-only stand-in (see benchmarks/peers/standin.py)")

    def __mro_entries__(self, bases) -> tuple[type]:
        # `class X(uvicorn.Server)` runs at import time; X may be defined but never instantiated.
        return (_base_class(self._path),)

    def __repr__(self) -> str:
        return f"<stand-in {self._path}>"


def _base_class(path: str) -> type:
    """A class standing for `path` as a base class: defining subclasses works, instantiating raises."""

    def __new__(cls, *args, **kwargs):
        raise StandInUsed(f"{cls.__qualname__} (a subclass of {path}) was instantiated, but {path.split('.')[0]!r} "
                          "is slipstream's import-only stand-in")

    return type(path.rsplit(".", 1)[-1], (), {"__new__": __new__, "__module__": path.rsplit(".", 1)[0]})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every submodule `<package>.<sub>` of a stand-in package as a stand-in module."""

    def __init__(self, package: str) -> None:
        self._prefix = package + "."

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(self._prefix):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install(package: str, namespace: dict) -> Callable[[str], Placeholder]:
    """Make `package` a stand-in: returns its module-level `__getattr__` and serves its submodules."""
    namespace["IS_SLIPSTREAM_STANDIN"] = True
    namespace["__version__"] = "0.0.0+slipstream.standin"
    if package == "ray":
        namespace["remote"] = _ray_remote
    sys.meta_path.insert(0, _Finder(package))

    def __getattr__(name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{package}.{name}")

    return __getattr__


def _ray_remote(*args, **kwargs):
    """`@ray.remote` / `@ray.remote(num_cpus=...)` run at import time: the decorated object becomes a placeholder."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return Placeholder(f"ray.remote({args[0].__qualname__})")
    return lambda obj: Placeholder(f"ray.remote({obj.__qualname__})")


def write_standin_site(directory: str | Path) -> Path:
    """Write one stand-in package per name of STANDINS into `directory` (created); returns it."""
    directory = Path(directory)
    for name in STANDINS:
        (directory / name).mkdir(parents=True, exist_ok=True)
        (directory / name / "__init__.py").write_text(_PACKAGE_INIT.format(name=name))
    return directory
