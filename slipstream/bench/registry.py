"""The suite's registry: an entry is a named benchmark, its rows, and what it needs (suite.py runs them).

Entries live in the repository's benchmarks/suite_entries.py and register themselves there; to add one (a rollout benchmark,
an rl-step run), write its rows(quick) and call `register(Entry(...))`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One measurement of an entry."""

    name: str
    """Unique within the entry; results files and docs refer to rows by it."""
    run: Callable[[], dict]
    """Measures and returns a JSON-ready dict with at least `kind` and `status` ("ok" rows carry numbers)."""
    estimate_s: int = 120
    """About how long it takes at full size (warm-up and start-up included): --budget-s and the timeout use it."""
    min_gpus: int = 0
    """GPUs the row needs (torchrun rows); fewer: the row is skipped with the reason."""


@dataclass(frozen=True)
class Entry:
    """A named benchmark: its rows at full size or CPU-sized (`quick`), and what it needs."""

    name: str
    description: str
    rows: Callable[[bool], list[Row]]
    """rows(quick) -> the entry's rows; quick = CPU-sized, seconds."""
    device: str = "gpu"
    """"gpu": needs CUDA at full size; "cpu": measured on the CPU; "any": on whatever device is there."""
    min_gpus: int = 1
    """GPUs the full-size entry needs (device "gpu")."""
    has_quick: bool = True
    """Whether rows(True) is a meaningful CPU-sized version (else --quick skips the entry with the reason)."""
    summary: Callable[[list[dict]], dict] | None = None
    """Ratios and headline figures computed from this results file's rows only."""
    allocator: str | None = "expandable_segments:True"
    """PYTORCH_CUDA_ALLOC_CONF of the rows' processes unless the caller set one; None: torch's default, as the
    entry's own command gets when run alone (under expandable segments a large allocation inside a timed call, such
    as a rollout's new KV cache, maps its memory there: 0.2-0.3 s more in the first rollout calls measured so)."""


REGISTRY: dict[str, Entry] = {}


def register(entry: Entry) -> Entry:
    """Add an entry to the suite (names are unique)."""
    if entry.name in REGISTRY:
        raise ValueError(f"suite entry {entry.name!r} is registered twice")
    REGISTRY[entry.name] = entry
    return entry


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
