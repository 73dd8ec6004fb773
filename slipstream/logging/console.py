"""Console sink: a rich progress bar over the run plus a compact metrics line every k steps."""

from __future__ import annotations

import math
from typing import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Shown in the bar description, first key found wins for each label.
_HEADLINE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("loss", ("actor/pg_loss", "actor/loss")),
    ("step", ("perf/step_time",)),
)

# The compact line: headline metrics plus the ones people look at when a run misbehaves.
_LINE_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("pg_loss", ("actor/pg_loss",)),
    ("kl", ("actor/kl",)),
    ("entropy", ("actor/entropy",)),
    ("grad_norm", ("actor/grad_norm",)),
    ("resp_len", ("rollout/response_len/mean", "rollout/response_len_mean")),
    ("step_s", ("perf/step_time",)),
    ("rollout_s", ("perf/rollout_time",)),
    ("train_s", ("perf/actor_train_time",)),
    ("mfu", ("perf/actor_train_mfu",)),
)


def _first(metrics: Mapping[str, float], keys: tuple[str, ...]) -> float | None:
    return next((metrics[key] for key in keys if key in metrics), None)


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.4g}"


class ConsoleSink:
    """Progress bar over `total_steps` (description: reward, loss, step time) and, every
    `print_every` steps, one compact line of the main metrics printed above the bar."""

    def __init__(
        self,
        total_steps: int | None = None,
        print_every: int = 10,
        console: Console | None = None,
        start_step: int = 0,
    ):
        if print_every < 1:
            raise ValueError(f"print_every must be >= 1, got {print_every}")
        self.print_every = print_every
        self.console = console if console is not None else Console()
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        # A resumed run starts the bar at the step it resumes from.
        self._task = self._progress.add_task("starting", total=total_steps, completed=start_step)
        self._progress.start()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Advance the bar to `step` (steps count from 1) and print the compact line if due."""
        parts = []
        for label, keys in _HEADLINE:
            value = _first(metrics, keys)
            if value is not None:
                parts.append(f"{label} {_fmt(value)}" + ("s" if label == "step" else ""))
        # `completed=step` rather than advance(1): steps may be skipped or repeated across resumes.
        self._progress.update(self._task, completed=step, description=" | ".join(parts) or f"step {step}")
        if step % self.print_every == 0:
            # soft_wrap: one physical line per step even where the console has no real width
            # (a log file or a pipe, which rich treats as 80 columns)
            self._progress.console.print(self.format_line(step, metrics), highlight=False, soft_wrap=True)

    @staticmethod
    def format_line(step: int, metrics: Mapping[str, float]) -> str:
        """`step 10 | reward 0.52 | pg_loss -0.013 | ...` over the keys that were logged."""
        values = ((label, _first(metrics, keys)) for label, keys in _LINE_KEYS)
        fields = [f"{label} {_fmt(value)}" for label, value in values if value is not None]
        return " | ".join([f"step {step}", *fields])

    def close(self) -> None:
        """Stop the live bar (leaves its last state on screen)."""
        self._progress.stop()
