"""Generate the config reference (docs/config.md) from the dataclasses' field docstrings."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import get_args, get_origin, get_type_hints

from slipstream.config import schema


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the string literal that follows its annotation in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp) -> str:
    return str(tp).replace("typing.", "").replace("slipstream.config.schema.", "").replace("<class '", "").replace("'>", "")


def render_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `slipstream/config/schema.py` by `python -m slipstream.config.docs`;",
        "a test fails when this file and the dataclasses disagree. Set any field in a recipe",
        "(YAML, by section) or on the command line as `section.key=value`.",
        "",
    ]
    root = schema.Config()
    for section in dataclasses.fields(schema.Config):
        cls = get_type_hints(schema.Config)[section.name]
        lines += [f"## `{section.name}` — {inspect.getdoc(cls)}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        lines += _rows(cls, getattr(root, section.name), section.name)
        hints = get_type_hints(cls)
        named = []  # dict[str, Dataclass] fields: one table of the sub-section's keys after this one
        for f in dataclasses.fields(cls):
            args = get_args(hints[f.name])
            if get_origin(hints[f.name]) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
                named.append((f"{section.name}.{f.name}.<name>", args[1]))
        lines.append("")
        for prefix, sub in named:
            sub_docs, sub_hints, sub_defaults = field_docs(sub), get_type_hints(sub), sub()
            lines += [f"### `{prefix}` — {inspect.getdoc(sub)}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
            for f in dataclasses.fields(sub):
                typ = _type_name(sub_hints[f.name]).replace("|", "\\|")
                default = getattr(sub_defaults, f.name)
                lines.append(f"| `{prefix}.{f.name}` | `{typ}` | `{default!r}` | {sub_docs.get(f.name, '')} |")
            lines.append("")
    return "\n".join(lines)


def _rows(cls: type, defaults, prefix: str) -> list[str]:
    """One table row per field; a nested section (logging.wandb) lists its own fields under its prefix."""
    docs, hints, rows = field_docs(cls), get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            rows += _rows(hints[f.name], default, f"{prefix}.{f.name}")
            continue
        typ = _type_name(hints[f.name]).replace("|", "\\|")
        rows.append(f"| `{prefix}.{f.name}` | `{typ}` | `{default!r}` | {docs.get(f.name, '')} |")
    return rows


if __name__ == "__main__":
    print(render_reference(), end="")
