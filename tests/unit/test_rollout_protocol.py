"""The rollout protocols (rollout/base.py) declare what callers use, and the engines implement it.

Every attribute the controller, the evaluator and the rollout benchmark use on a rollout engine is found in
their source with ast; each must be declared by a protocol, and each call must pass only arguments the
protocol's signature takes. The engines (BuiltinRollout, the trainer's RemoteRollout, the producer test's
fake) must accept every call the protocols they stand for allow.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Generic, Protocol

import pytest
import torch

from slipstream.controller.placement import RemoteRollout
from slipstream.models.presets import get_preset
from slipstream.rollout.base import RolloutEngine, RolloutReplica, StreamingRolloutEngine
from slipstream.rollout.builtin import BuiltinRollout
from test_producer import GatedRollout

PACKAGE = Path(__file__).resolve().parents[2] / "slipstream"
ENGINE_NAMES = {"rollout", "eval_engine"}
"""Names under which the trainer holds a rollout engine (`self.rollout`, `st.rollout`, `self.stages.rollout`, ...)."""
CALLERS = {
    **{path: ENGINE_NAMES for path in sorted((PACKAGE / "controller").glob("*.py"))},
    **{path: ENGINE_NAMES for path in sorted((PACKAGE / "eval").glob("*.py"))},
    PACKAGE / "bench" / "rollout.py": {"engine"},  # the BuiltinRollout it builds (no trainer there)
}
CONFIG_NAMES = {"cfg", "config"}
"""Holders of the config tree, whose `rollout` is the config section, not an engine."""
REMOTE_ONLY = {"gather_batch", "wait_ratio"}
"""RemoteRollout's own members: the disaggregated loop's rollout is always one (placement.py)."""
BENCH_ONLY = {"warmup", "runner", "core", "startup_s"}
"""BuiltinRollout's own members that `slipstream bench rollout` reads from the engine it builds itself."""
PROTOCOLS = (RolloutReplica, RolloutEngine, StreamingRolloutEngine)


def declared(protocol: type) -> set[str]:
    """Members a protocol declares itself or through its bases (methods, properties and annotated data)."""
    names = set()
    for cls in protocol.__mro__:
        if cls not in (object, Protocol, Generic):
            names |= {n for n in vars(cls) if not n.startswith("_")} | set(vars(cls).get("__annotations__", {}))
    return names


def engine_uses(path: Path, engine_names: set[str]) -> list[tuple[str, ast.Call | None, str]]:
    """(member, its call or None for a plain read, where) of every use of an engine-named object in a file."""
    tree = ast.parse(path.read_text())
    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    uses = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        holder = node.value
        name = holder.attr if isinstance(holder, ast.Attribute) else getattr(holder, "id", None)
        owner = holder.value if isinstance(holder, ast.Attribute) else None
        owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
        if name in engine_names and owner_name not in CONFIG_NAMES:
            uses.append((node.attr, calls.get(id(node)), f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"))
    return uses


def all_uses() -> list[tuple[str, ast.Call | None, str]]:
    return [use for path, names in CALLERS.items() for use in engine_uses(path, names)]


def protocol_member(name: str):
    for protocol in PROTOCOLS:
        if name in vars(protocol):
            return protocol, vars(protocol)[name]
    return None, None


def test_callers_use_engines():
    """The search sees the calls it is meant to check (so an empty result cannot pass the tests below)."""
    used = {name for name, _, _ in all_uses()}
    assert {"generate", "submit", "step", "has_work", "update_weights", "sleep", "state_dict", "load_state_dict",
            "device"} <= used  # fmt: skip


def test_protocols_declare_every_member_callers_use():
    known = set().union(*(declared(p) for p in PROTOCOLS))
    undeclared = sorted({f"{where} .{name}" for name, _, where in all_uses()
                         if name not in known | REMOTE_ONLY | BENCH_ONLY})  # fmt: skip
    assert undeclared == []


def test_every_call_fits_the_protocol_signature():
    bad = []
    for name, call, where in all_uses():
        _, member = protocol_member(name)
        if call is None or not inspect.isfunction(member):
            continue
        params = list(inspect.signature(member).parameters.values())[1:]  # without self
        try:
            inspect.Signature(params).bind(*call.args, **{k.arg: None for k in call.keywords if k.arg})
        except TypeError as err:
            bad.append(f"{where} {name}: {err}")
    assert bad == []


def compatibility_problems(protocol: type, impl: object) -> list[str]:
    """Where `impl` does not take every call the protocol's methods allow (names, order, defaults)."""
    problems = []
    for name in sorted(declared(protocol)):
        _, member = protocol_member(name)
        if not hasattr(impl, name):
            problems.append(f"{name}: missing")
            continue
        if isinstance(member, property):
            if not isinstance(inspect.getattr_static(impl, name), property):
                problems.append(f"{name}: not a property")
            continue
        if not inspect.isfunction(member):
            continue
        want = list(inspect.signature(member).parameters.values())[1:]
        got = list(inspect.signature(getattr(impl, name)).parameters.values())
        got_by_name = {p.name: p for p in got}
        for i, p in enumerate(want):
            q = got_by_name.get(p.name)
            if q is None:
                problems.append(f"{name}: no parameter {p.name}")
            elif p.kind is p.POSITIONAL_OR_KEYWORD and (i >= len(got) or got[i].name != p.name):
                problems.append(f"{name}: {p.name} is not parameter {i}")
            elif p.default is not p.empty and q.default is p.empty:
                problems.append(f"{name}: {p.name} needs a default")
        extra = [q.name for q in got if q.name not in {p.name for p in want} and q.default is q.empty
                 and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]  # fmt: skip
        if extra:
            problems.append(f"{name}: requires {extra}")
    return problems


@pytest.fixture(scope="module")
def builtin():
    return BuiltinRollout(get_preset("tiny"), max_batch_size=2, seed=0)


@pytest.mark.parametrize("protocol", [RolloutEngine, StreamingRolloutEngine])
def test_builtin_rollout_implements(builtin, protocol):
    assert compatibility_problems(protocol, builtin) == []


def test_remote_rollout_implements_the_replica():
    remote = RemoteRollout(SimpleNamespace(rank=0), torch.device("cpu"))
    assert compatibility_problems(RolloutReplica, remote) == []


def test_the_producers_fake_implements_streaming():
    assert compatibility_problems(StreamingRolloutEngine, GatedRollout(n=1)) == []


def test_the_check_finds_a_narrow_implementation():
    """An engine whose generate takes no keys or budgets, with no streaming at all, is reported."""

    class Narrow:
        device = torch.device("cpu")

        def generate(self, prompts, sampling):
            return []

        def update_weights(self, named_tensors, version): ...
        def sleep(self): ...
        def wake(self): ...
        def state_dict(self): return {}  # noqa: E704
        def load_state_dict(self, state): ...

    assert compatibility_problems(RolloutEngine, Narrow()) == ["generate: no parameter keys", "generate: no parameter budgets"]
    assert "submit: missing" in compatibility_problems(StreamingRolloutEngine, Narrow())
