"""MetricsLogger: one `log(step, metrics)` call fanned out to every configured sink."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from slipstream.logging.backends import make_tensorboard_sink, make_wandb_sink
from slipstream.logging.console import ConsoleSink
from slipstream.logging.jsonl import JsonlSink


class Sink(Protocol):
    """Where metrics go: a file, the terminal, a dashboard."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _to_float(name: str, value: Any) -> float:
    # Accept Python numbers, numpy scalars and one-element tensors; convert once, here, so every
    # sink sees plain floats (float() of a CUDA tensor syncs, which is fine at logging time).
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"metric {name!r} is not a number: {value!r}") from None


class MetricsLogger:
    """Fan-out of metrics to sinks. Call it on one process only (rank 0) in distributed runs."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Send `metrics` for `step` to every sink, values converted to float."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        values = {name: _to_float(name, value) for name, value in metrics.items()}
        for sink in self.sinks:
            sink.log(step, values)

    def close(self) -> None:
        """Close every sink once (flushes files, stops the progress bar, finishes wandb)."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_sinks(
    run_dir: str | Path,
    *,
    total_steps: int | None = None,
    console: bool = True,
    log_every: int = 10,
    start_step: int = 0,
    tensorboard: bool = True,
    wandb: bool = False,
    wandb_project: str = "slipstream",
    run_name: str | None = None,
    run_id: str | None = None,
    config: Mapping[str, Any] | None = None,
    wandb_mode: str = "online",
    wandb_tags: Sequence[str] = (),
) -> list[Sink]:
    """The standard sinks of a run: `run_dir/metrics.jsonl` always, then the console (bar plus a
    line every `log_every` steps), TensorBoard (`run_dir/tb`, skipped if unavailable) and wandb
    (only if `wandb=True` and installed). `start_step` is the step a resumed run starts from."""
    run_dir = Path(run_dir)
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if console:
        sinks.append(ConsoleSink(total_steps=total_steps, print_every=log_every, start_step=start_step))
    if tensorboard:
        tb = make_tensorboard_sink(run_dir / "tb", purge_step=start_step + 1 if start_step else None)
        if tb is not None:
            sinks.append(tb)
    if wandb:
        wb = make_wandb_sink(wandb_project, run_dir, run_name=run_name, run_id=run_id, config=config,
                             mode=wandb_mode, tags=wandb_tags)  # fmt: skip
        if wb is not None:
            sinks.append(wb)
    return sinks


def make_metrics_logger(run_dir: str | Path, **kwargs: Any) -> MetricsLogger:
    """A MetricsLogger over `build_sinks(run_dir, **kwargs)`."""
    return MetricsLogger(build_sinks(run_dir, **kwargs))
