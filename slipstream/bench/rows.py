"""Rows of a benchmark matrix: the JSONL schema every cell writes, and reading it back.

A row read on its own says what was measured: the cell, its status (only "ok" rows carry
numbers), the phases with their statistics, the fairness checklist (this cell's own settings:
engine, processes, dtype, compile, recompute, micro-batching, padding, ...) and the environment.
"""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = "slipstream.bench.matrix/1"
STATUSES = ("ok", "missing", "not-available", "not-applicable", "oom", "error")
ROW_KEYS = (
    "schema", "cell", "workload", "framework", "backend", "mode", "status", "reason", "install",
    "held_constant", "phases", "metrics", "micro_batches", "fairness", "impl", "env",
)  # fmt: skip
FAIRNESS_KEYS = (
    "engine", "processes", "compile", "dtype", "params_dtype", "attention_kernel", "recompute", "real_tokens",
    "padded_tokens", "padding_fraction", "loss_normalisation", "optimizer", "micro_batching", "logprob_head",
)  # fmt: skip
"""A train-step row's own settings (its `fairness` dict): each row states them, no table header does."""


def add_noise(phases: dict[str, dict]) -> dict[str, dict]:
    """Each phase with `rel_spread` = (max - min) / median of its timed repeats."""
    return {name: {**p, "rel_spread": (p["time_max_s"] - p["time_min_s"]) / p["time_s"]} for name, p in phases.items()}



def read_rows(path: str | Path) -> list[dict]:
    """Rows of a results JSONL file (blank lines ignored)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not a JSON row ({err})") from None
    return rows
