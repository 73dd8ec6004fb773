"""Reward registry: names -> functions, custom "module:function" / "file.py:function" specs, weighting."""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Callable, Sequence, Union

from slipstream.rewards.functions import countdown_reward, exact_reward, format_reward, math_reward
from slipstream.rewards.reasoning_gym import rg_reward

RewardFn = Callable[[str, Union[str, None], str], Union[float, dict]]
RewardSpec = Union[str, RewardFn]

REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact": exact_reward,
    "format": format_reward,
    "countdown": countdown_reward,
    "rg": rg_reward,
}
BUILTIN_REWARDS = frozenset(REWARDS)
EXTRACTING_REWARDS = frozenset({"math", "countdown", "rg"})
"""Built-in rewards that read the answer span of a completion (`reward.extract`)."""
FILE_MODULE_PREFIX = "_slipstream_reward_"
"""Module-name prefix of reward files imported by path (see `_load_file_module`)."""


def register_reward(name: str, fn: RewardFn) -> None:
    """Register `fn` under `name` (custom names must not contain ':')."""
    if ":" in name:
        raise ValueError(f"reward name {name!r} must not contain ':' (reserved for module:function specs)")
    if name in REWARDS and REWARDS[name] is not fn:
        raise ValueError(f"a different reward is already registered as {name!r}")
    REWARDS[name] = fn


def with_extract(spec: RewardSpec, extract: str) -> RewardSpec:
    """`spec` reading the answer with `extract` (reward.extract): a picklable partial of the built-in
    math / countdown / rg reward when `extract` is not "auto"; any other spec unchanged."""
    if extract == "auto" or not (isinstance(spec, str) and spec in EXTRACTING_REWARDS):
        return spec
    return functools.partial(REWARDS[spec], extract=extract)


def _load_file_module(path: Path):
    """Import a .py file once per process under a stable private module name."""
    resolved = path.resolve()
    if not resolved.is_file():
        raise ValueError(f"reward file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"{FILE_MODULE_PREFIX}{resolved.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before exec so that dataclasses / pickling inside the file can find the module.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def resolve_reward(spec: RewardSpec) -> RewardFn:
    """A reward function from a registered name, "package.module:function" or "path/file.py:function"."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec must be a non-empty string or a callable, got {spec!r}")
    if ":" not in spec:
        if spec in REWARDS:
            return REWARDS[spec]
        close = difflib.get_close_matches(spec, list(REWARDS), n=1, cutoff=0.0)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown reward {spec!r}{hint} (registered: {', '.join(sorted(REWARDS))}; "
            "custom rewards are given as 'package.module:function' or 'path/to/file.py:function')"
        )
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"reward spec {spec!r} must look like 'module:function' or 'file.py:function'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file_module(Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ValueError(f"reward spec {spec!r}: cannot import module {target!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward spec {spec!r}: module {target!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward spec {spec!r}: {attr!r} is not callable")
    return fn


def reward_name(spec: RewardSpec) -> str:
    """Short name used in logs and info dicts: a registered name, or the function's name."""
    if isinstance(spec, str):
        # "path/to/file.py:fn" and "pkg.module:fn" are named "fn": metric keys stay short.
        return spec.rpartition(":")[2]
    if isinstance(spec, functools.partial):  # e.g. with_extract's: keeps the registered name
        registered = next((name for name, fn in REWARDS.items() if fn is spec.func), None)
        return registered or reward_name(spec.func)
    return getattr(spec, "__name__", type(spec).__name__)


def to_score(value: float | dict | bool | int, name: str) -> tuple[float, dict]:
    """Split a reward's return value into a finite float score and extra info."""
    extra: dict = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward {name!r} returned a dict without a 'score' key: {sorted(value)}")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    try:
        score = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward {name!r} returned {type(value).__name__}, expected a number") from e
    # A NaN / inf reward would silently poison the group-normalised advantages downstream.
    if not math.isfinite(score):
        raise ValueError(f"reward {name!r} returned a non-finite score {score}")
    return score, extra


class CombinedReward:
    """Weighted sum of several rewards; per-reward scores are reported in the info dict."""

    def __init__(self, specs_with_weights: Sequence[tuple[RewardSpec, float]], names: Sequence[str] | None = None):
        """`names` overrides the info keys (default: registered name or function name)."""
        if not specs_with_weights:
            raise ValueError("CombinedReward needs at least one (reward, weight) pair")
        if names is not None and len(names) != len(specs_with_weights):
            raise ValueError(f"got {len(names)} names for {len(specs_with_weights)} rewards")
        self.names: list[str] = []
        self.fns: list[RewardFn] = []
        self.weights: list[float] = []
        for entry in specs_with_weights:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
                raise ValueError(f"expected (reward_spec, weight) pairs, got {entry!r}")
            spec, weight = entry
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"weight of reward {reward_name(spec)!r} must be a finite number, got {weight!r}")
            name = reward_name(spec) if names is None else names[len(self.names)]
            # Same reward twice (e.g. two format patterns): keep both, disambiguate the info key.
            base, k = name, 1
            while name in self.names:
                k += 1
                name = f"{base}#{k}"
            self.names.append(name)
            self.fns.append(resolve_reward(spec))
            self.weights.append(float(weight))

    def score(self, completion: str, answer: str | None, prompt: str) -> tuple[float, dict]:
        """(weighted total, info) where info[name] is each reward's unweighted score."""
        total = 0.0
        info: dict = {}
        for name, fn, weight in zip(self.names, self.fns, self.weights):
            score, extra = to_score(fn(completion, answer, prompt), name)
            total += weight * score
            info[name] = score
            info.update({f"{name}/{k}": v for k, v in extra.items()})
        return total, info

    def __call__(self, completion: str, answer: str | None, prompt: str) -> dict:
        total, info = self.score(completion, answer, prompt)
        return {"score": total, **info}
