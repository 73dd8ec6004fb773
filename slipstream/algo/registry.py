"""Name -> pure function tables for the algo package, with one error message for unknown names.

Registries are looked up once, when the run's config is built, so the training loop never
branches on an algorithm name.
"""

from __future__ import annotations

from typing import TypeVar

F = TypeVar("F")


def lookup(registry: dict[str, F], kind: str, name: str) -> F:
    """Return `registry[name]`, or raise ValueError naming the known entries of this `kind`."""
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; expected one of: {known}") from None


def register(registry: dict[str, F], name: str):
    """Decorator that adds a function to `registry` under `name` (names must be unique)."""

    def deco(fn: F) -> F:
        if name in registry:
            raise ValueError(f"{name!r} is already registered")
        registry[name] = fn
        return fn

    return deco
