"""The run directory across runs: start fresh, resume, or refuse, before anything is built.

A run directory holds one run. Started again it resumes from its newest checkpoint; a directory
that holds an earlier run's output but no checkpoint is refused (it cannot be continued, and
appending to its metrics would mix two runs) unless the caller asked to overwrite it. A resume
whose config differs from the run's config.yaml beyond `SAFE_TO_CHANGE` is refused too
(`check_resume_config`; `slipstream train --allow-config-change` accepts it). A resumed
run's metrics.jsonl keeps the rows up to the checkpoint's step; rows logged after it (by steps
that were run but never saved) move to metrics.dropped.jsonl, so every step has one row.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

from slipstream.checkpoint.manager import CheckpointManager
from slipstream.config.schema import Config, TrainerSection

log = logging.getLogger(__name__)

OUTPUTS = (
    "checkpoints", "metrics.jsonl", "metrics.dropped.jsonl", "config.yaml", "tb", "hf", "report.png", "wandb",
    "wandb_run_id",
)  # fmt: skip
"""What a run writes into its run_dir (`--overwrite` removes exactly these)."""


SAFE_TO_CHANGE = (
    "trainer.total_steps", "trainer.run_dir", "trainer.save_every", "trainer.keep_last", "trainer.export_hf",
    "trainer.stall_dump_s", "trainer.peak_flops", "logging", "eval.every_steps", "eval.before_training",
)  # fmt: skip
"""Config keys (or whole sections) a resumed run may change: how long it runs, what it logs and saves,
and when it evaluates. Anything else (the model, data, algorithm, rollout, an eval set) makes it
another run, whose metrics and checkpoints must not mix with this one's."""


class RunComplete(Exception):
    """The run in run_dir already reached trainer.total_steps: there is nothing to train."""


def open_run_dir(trainer: TrainerSection, *, overwrite: bool = False, rank: int = 0) -> Path:
    """The run directory, ready for this run; ValueError or RunComplete when it cannot or need not run.

    Resuming: the newest checkpoint must be at a step below trainer.total_steps (equal: RunComplete).
    Starting fresh: the directory must hold no earlier output, unless `overwrite` (rank 0 removes it).
    """
    run_dir = Path(trainer.run_dir)
    if overwrite:
        if rank == 0:
            for name in OUTPUTS:
                path = run_dir / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    steps = CheckpointManager(run_dir / "checkpoints").steps()
    if steps:
        latest = steps[-1]
        if not trainer.resume:
            raise ValueError(
                f"trainer.run_dir={str(run_dir)!r} already holds checkpoints (newest step_{latest:06d}) and "
                "trainer.resume=false: pick a new trainer.run_dir, set trainer.resume=true to continue that run, "
                "or pass --overwrite to start it over"
            )
        if latest > trainer.total_steps:
            raise ValueError(
                f"trainer.total_steps={trainer.total_steps} is below step {latest} of the newest checkpoint in "
                f"{run_dir / 'checkpoints'}: set trainer.total_steps >= {latest} to continue that run, or pick a new "
                "trainer.run_dir (or pass --overwrite) to start over"
            )
        if latest == trainer.total_steps:
            raise RunComplete(
                f"{run_dir} is complete: its newest checkpoint is at step {latest} = trainer.total_steps; "
                "raise trainer.total_steps to train it further"
            )
    else:
        found = [name for name in OUTPUTS if (run_dir / name).exists()]
        if found:
            raise ValueError(
                f"trainer.run_dir={str(run_dir)!r} holds an earlier run without a checkpoint ({', '.join(found)}): "
                "pass --overwrite to replace it, or pick a new trainer.run_dir"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def missing_outputs(trainer: TrainerSection) -> list[str]:
    """The final outputs a run in trainer.run_dir lacks: `hf` (with trainer.export_hf) and `report.png`
    (when there are metrics to plot). A run stopped between its final checkpoint and its end has them
    missing while its checkpoint says it is complete."""
    run_dir = Path(trainer.run_dir)
    missing = []
    if trainer.export_hf and not (run_dir / "hf").is_dir():
        missing.append("hf")
    if (run_dir / "metrics.jsonl").is_file() and not (run_dir / "report.png").is_file():
        missing.append("report.png")
    return missing


def check_resume_config(cfg: Config, *, allow_change: bool = False) -> None:
    """ValueError when cfg would resume the run in trainer.run_dir with a config that differs from the
    run's config.yaml beyond `SAFE_TO_CHANGE`; the message lists each difference as `key: old -> new`.

    Called before anything is built or written: a refused resume leaves the run as it was.
    """
    from slipstream.config.loader import load_config  # the loader imports the schema only

    run_dir = Path(cfg.trainer.run_dir)
    saved = run_dir / "config.yaml"
    if allow_change or not cfg.trainer.resume or not saved.is_file():
        return
    if not CheckpointManager(run_dir / "checkpoints").steps():
        return  # nothing to resume: open_run_dir refuses or starts fresh
    changes = [c for c in config_changes(asdict(load_config(saved)), asdict(cfg)) if not _safe(c.split(":")[0])]
    if changes:
        raise ValueError(
            f"{run_dir} holds a run with another config; resuming it would mix two runs' metrics and checkpoints:\n  "
            + "\n  ".join(changes)
            + "\npick a new trainer.run_dir, or pass `slipstream train --allow-config-change` to resume it with these "
            f"changes (safe to change without it: {', '.join(SAFE_TO_CHANGE)})"
        )


def config_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for every dotted key whose value differs between two config trees."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def _safe(key: str) -> bool:
    return any(key == safe or key.startswith(f"{safe}.") for safe in SAFE_TO_CHANGE)


def rewind_metrics(run_dir: Path, step: int) -> None:
    """Keep the rows of run_dir/metrics.jsonl up to `step` (the resume point); move later ones (and a
    line cut short by a kill) to metrics.dropped.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    keep, drop = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            row_step = None
        (keep if row_step is not None and row_step <= step else drop).append(line + "\n")
    if not drop:
        return
    with (run_dir / "metrics.dropped.jsonl").open("a", encoding="utf-8") as f:
        f.writelines(drop)
    tmp = path.with_name("metrics.jsonl.tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    tmp.replace(path)
    log.info("resuming at step %d: %d rows of metrics.jsonl logged after that checkpoint moved to %s",
             step, len(drop), run_dir / "metrics.dropped.jsonl")  # fmt: skip
