"""Optional sinks for external dashboards: TensorBoard and Weights & Biases.

Both are created through `make_*` functions that return None when the package is missing, so a
run never fails because a dashboard is not installed.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

logger = logging.getLogger(__name__)


class TensorBoardSink:
    """Writes every finite metric as a scalar with `global_step=step` to a TensorBoard event file."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the events of earlier files from this step on, so a run resumed
        # from an older checkpoint does not show two curves over the steps it repeats
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add one scalar per metric; NaN / inf are skipped (TensorBoard charts break on them)."""
        for name, value in metrics.items():
            if math.isfinite(value):
                self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def make_tensorboard_sink(log_dir: str | Path, purge_step: int | None = None) -> TensorBoardSink | None:
    """A TensorBoardSink, or None (logged at info) when `torch.utils.tensorboard` cannot import."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (needs the separate `tensorboard` package)
    except ImportError as err:
        logger.info("TensorBoard logging unavailable (%s); install `tensorboard` to enable it", err)
        return None
    return TensorBoardSink(log_dir, purge_step=purge_step)


class WandbSink:
    """Logs metrics to a Weights & Biases run; `run_id` lets a resumed run continue the same chart."""

    def __init__(
        self,
        project: str,
        run_dir: str | Path,
        run_name: str | None = None,
        run_id: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: str = "online",
        tags: Sequence[str] = (),
    ) -> None:
        import wandb

        self._run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow" if run_id is not None else None,
            dir=str(run_dir),
            config=dict(config) if config is not None else None,
            mode=mode,
            tags=list(tags) or None,
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log the metrics at `step` (wandb accepts NaN and shows gaps)."""
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the wandb run."""
        self._run.finish()


def make_wandb_sink(
    project: str,
    run_dir: str | Path,
    run_name: str | None = None,
    run_id: str | None = None,
    config: Mapping[str, Any] | None = None,
    mode: str = "online",
    tags: Sequence[str] = (),
) -> WandbSink | None:
    """A WandbSink, or None with a warning when wandb was asked for but is not installed."""
    if importlib.util.find_spec("wandb") is None:
        logger.warning("logging.wandb.enabled is set but wandb is not installed (pip install wandb): W&B logging is skipped")
        return None
    return WandbSink(project, run_dir, run_name=run_name, run_id=run_id, config=config, mode=mode, tags=tags)
