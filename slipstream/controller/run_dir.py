"""The run directory across runs: start fresh, resume, or refuse, before anything is built.

A run directory holds one run. Started again it resumes from its newest checkpoint; a directory
that holds an earlier run's output but no checkpoint is refused (it cannot be continued, and
appending to its metrics would mix two runs) unless the caller asked to overwrite it. A resumed
run's metrics.jsonl keeps the rows up to the checkpoint's step; rows logged after it (by steps
that were run but never saved) move to metrics.dropped.jsonl, so every step has one row.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from slipstream.checkpoint.manager import CheckpointManager
from slipstream.config.schema import TrainerSection

log = logging.getLogger(__name__)

OUTPUTS = (
    "checkpoints", "metrics.jsonl", "metrics.dropped.jsonl", "config.yaml", "tb", "hf", "report.png", "wandb",
    "wandb_run_id",
)  # fmt: skip
"""What a run writes into its run_dir (`--overwrite` removes exactly these)."""


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
