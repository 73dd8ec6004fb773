"""Build a `Config` from YAML recipes and dotted `key=value` overrides, with strict checking.

Unknown keys and values of the wrong type are rejected with a message that names the key
and, for a misspelt key, the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from slipstream.config.schema import Config


MOVED_KEYS = {"trainer.tensorboard": "logging.tensorboard", "trainer.log_every": "logging.log_every"}
"""Keys that moved to another section: an old recipe gets the new name, not a guess."""


class RecipeError(ValueError):
    """An error located in a recipe file or an override: the message starts with `file:line:column:`
    or `command line:`."""


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML recipe <- command-line overrides, validated into a `Config`.

    A YAML syntax error, and a bad key or value that comes from the recipe, raise RecipeError
    naming the file, line and column; a bad key or value from an override, RecipeError naming
    the command line.
    """
    tree: dict = {}
    marks: dict[str, str] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ValueError(f"recipe {str(path)!r} does not exist")
        text = path.read_text()
        try:
            loaded = yaml.safe_load(text)
        except yaml.MarkedYAMLError as err:
            raise RecipeError(_yaml_error(path, err)) from None
        except yaml.YAMLError as err:  # unmarked (e.g. a bad encoding): no position to give
            raise RecipeError(f"{path}: {' '.join(str(err).split())}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"{path}:1:1: a recipe is a mapping of sections, got a {type(loaded).__name__}")
        tree = loaded or {}
        marks = _key_positions(path, text)
    overridden = set()
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(tree, key, value)
        overridden.add(key)
    # An override replaces the recipe's value and everything under it.
    marks = {k: v for k, v in marks.items() if not any(k == o or k.startswith(f"{o}.") for o in overridden)}
    marks.update(dict.fromkeys(overridden, "command line"))
    try:
        return build(Config, tree, prefix="")
    except ValueError as err:
        where = _first_key_in(str(err), marks)
        if where is None:
            raise
        raise RecipeError(f"{where}: {err}") from None


def _yaml_error(path: Path, err: yaml.MarkedYAMLError) -> str:
    """`file:line:col: problem`, plus a second line for where the enclosing construct started."""
    mark = err.problem_mark or err.context_mark
    lines = [f"{path}:{mark.line + 1}:{mark.column + 1}: {err.problem or err.context}"]
    if err.context and err.problem and err.context_mark is not None:
        lines.append(f"{path}:{err.context_mark.line + 1}:{err.context_mark.column + 1}: ({err.context})")
    return "\n".join(lines)


def _key_positions(path: Path, text: str) -> dict[str, str]:
    """Dotted key -> "file:line:col" of every key in the recipe (from YAML nodes, no objects built)."""
    positions: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            positions[key] = f"{path}:{key_node.start_mark.line + 1}:{key_node.start_mark.column + 1}"
            walk(value_node, f"{key}.")

    walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return positions


def _first_key_in(message: str, positions: dict[str, str]) -> str | None:
    """Position of the key that `message` names first (quoted, or dotted as in "rollout.group_size=1").

    The first one is the key at fault: a later one is a hint ("unknown config key 'actor.lrr'; did
    you mean 'actor.lr'?") and must not send the user to the correct line.
    """
    found: list[tuple[int, str]] = []
    for key in positions:
        quoted = rf"'{re.escape(key)}'"
        dotted = rf"(?<![\w.]){re.escape(key)}(?![\w.])"  # a bare word like "model" is too common to match
        match = re.search(f"{quoted}|{dotted}" if "." in key else quoted, message)
        if match:
            found.append((match.start(), key))
    return positions[min(found)[1]] if found else None


def parse_override(item: str) -> tuple[str, Any]:
    """"actor.lr=1e-6" -> ("actor.lr", 1e-6); the value is parsed as YAML ("null", "[1, 2]", "true")."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {key!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def build(cls: type, data: Any, prefix: str) -> Any:
    """Recursively turn nested dicts into the dataclass `cls`, checking every key and type."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {data!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if f"{prefix}{key}" in MOVED_KEYS:
            raise ValueError(f"config key '{prefix}{key}' moved to '{MOVED_KEYS[f'{prefix}{key}']}'")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            raise ValueError(f"unknown config key '{prefix}{key}'{hint}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, data[name], prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = coerce(data[name], tp, f"{prefix}{name}")
    return cls(**kwargs)


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, key)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{key} must be one of {', '.join(map(repr, allowed))}, got {value!r}{hint}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            value = [value]  # a single value where a list is expected: "reward.functions=math"
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list, got {value!r}")
        return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        item_tp = get_args(tp)[1] if get_args(tp) else None
        if dataclasses.is_dataclass(item_tp):  # named sub-sections, e.g. eval.sets.<name>
            return {str(k): build(item_tp, v or {}, prefix=f"{key}.{k}.") for k, v in value.items()}
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{key} must be a string, got {value!r}")
    raise TypeError(f"{key}: unsupported annotation {tp}")  # a schema bug, not user input


def dump_yaml(cfg: Config, path: str | Path) -> None:
    """Write the resolved config; `load_config(path)` reads it back to an equal Config."""
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
