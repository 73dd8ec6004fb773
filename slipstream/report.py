"""One-page picture of a run: report.png drawn from run_dir/metrics.jsonl.

Two rows of 2 x 3 panels (reward, loss, KL, entropy, step time, throughput), then, when the run
has eval sets, one panel per set with the training reward and the set's eval scores over steps.

Usage: `python -m slipstream.report RUN_DIR`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import yaml
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from slipstream.logging.jsonl import read_metrics

# Step-time panel: the phases stacked per step, in pipeline order; any other perf/*_time
# phase found in the file is stacked after these.
_PHASE_ORDER = ("rollout", "reward", "old_log_probs", "ref_log_probs", "actor_train", "update_weights")
# A first step this many times the median of the others (compile, CUDA graphs, allocator warm-up), and
# above the slowest of them, is drawn off scale, so that the steady steps stay readable.
_WARMUP_RATIO = 3.0


def _series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, values) of `key` over the records that have it; None when never logged or all NaN."""
    steps = [r["step"] for r in records if key in r]
    values = np.array([r[key] for r in records if key in r], dtype=np.float64)
    if not steps or np.all(np.isnan(values)):
        return None
    return np.array(steps), values


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over the finite values in each window (NaN where none are)."""
    out = np.full_like(values, np.nan)
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        chunk = chunk[np.isfinite(chunk)]
        if chunk.size:
            out[i] = chunk.mean()
    return out


def _not_logged(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _line_panel(ax: Axes, records: Sequence[dict], keys: Sequence[str], title: str, smooth: int = 0) -> None:
    """Plot the first of `keys` that was logged, optionally with a smoothed line on top."""
    for key in keys:
        series = _series(records, key)
        if series is None:
            continue
        steps, values = series
        ax.plot(steps, values, alpha=0.35 if smooth else 1.0, label=key, marker="." if len(steps) < 30 else None)
        if smooth and len(values) > 1:
            ax.plot(steps, _smooth(values, smooth), label=f"{key} (mean of {smooth})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        return
    _not_logged(ax, title)


def _step_time_panel(ax: Axes, records: Sequence[dict]) -> None:
    title = "step time breakdown (s)"
    found = {key[len("perf/") : -len("_time")] for r in records for key in r if key.startswith("perf/") and key.endswith("_time")}
    # eval runs between steps, outside perf/step_time: it is not one of the step's phases
    phases = [p for p in _PHASE_ORDER if p in found] + sorted(found - set(_PHASE_ORDER) - {"step", "eval"})
    if not phases and "step" not in found:
        _not_logged(ax, title)
        return
    records = [r for r in records if "perf/step_time" in r or not any(k.startswith("eval/") for k in r)]
    steps = np.array([r["step"] for r in records])
    bottom = np.zeros(len(records))
    for phase in phases:
        # A phase missing from a step (or NaN) contributes nothing to that step's bar.
        heights = np.array([r.get(f"perf/{phase}_time", math.nan) for r in records], dtype=np.float64)
        heights = np.nan_to_num(heights, nan=0.0)
        ax.bar(steps, heights, bottom=bottom, width=0.8, label=phase)
        bottom += heights
    # The step's own wall time on top: with async rollout, phases overlap and the bars exceed it;
    # in a synchronous step the gap above the bars is time no phase accounted for.
    series = _series(records, "perf/step_time")
    if series is not None:
        ax.plot(*series, color="black", marker="_", linestyle="none", markersize=10, label="step")
    # a step's height is the larger of its stacked phases and its wall time (NaN where not logged)
    totals = np.fmax(bottom, np.array([r.get("perf/step_time", math.nan) for r in records], dtype=np.float64))
    if len(totals) >= 3 and totals[0] > max(_WARMUP_RATIO * np.nanmedian(totals[1:]), 1.15 * np.nanmax(totals[1:])):
        top = 1.15 * np.nanmax(totals[1:])
        ax.set_ylim(0, top)
        ax.annotate(f"step {steps[0]}: {totals[0]:.2f} s (warm-up, off scale)", xy=(steps[0], top),
                    xytext=(4, -12), textcoords="offset points", fontsize=7, ha="left")  # fmt: skip
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7, loc="upper right")  # the warm-up note sits at the top left


def _throughput_panel(ax: Axes, records: Sequence[dict], device: str) -> None:
    title = "throughput / MFU"
    tok_keys = ("perf/actor_train_tok_per_s", "perf/rollout_tokens_per_gpu_per_s")
    plotted = False
    for key in tok_keys:
        series = _series(records, key)
        if series is not None:
            ax.plot(*series, label=key.removeprefix("perf/").replace("_per_gpu", "") + f" (per {device})")
            plotted = True
    mfu = _series(records, "perf/actor_train_mfu")
    if not plotted and mfu is None:
        _not_logged(ax, title)
        return
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if plotted:
        ax.set_ylabel(f"tokens / s / {device}")
        ax.legend(fontsize=7, loc="upper left")
    if mfu is not None:
        # MFU is a fraction; on its own axis so it stays readable next to tokens/s.
        ax_mfu = ax.twinx() if plotted else ax
        ax_mfu.plot(mfu[0], 100 * mfu[1], color="tab:red", linestyle="--", label="actor_train MFU")
        ax_mfu.set_ylabel("MFU (%)")
        peak = _series(records, "perf/peak_tflops")
        label = "actor_train MFU" + (f" (peak {np.nanmax(peak[1]):.0f} TFLOP/s)" if peak is not None else "")
        ax_mfu.lines[-1].set_label(label)
        ax_mfu.legend(fontsize=7, loc="upper right")


def eval_sets(records: Sequence[dict]) -> list[str]:
    """Names of the eval sets logged (keys eval/<set>/...), in order of first appearance."""
    names: dict[str, None] = {}
    for r in records:
        for key in r:
            if key.startswith("eval/") and key.count("/") == 2:
                names.setdefault(key.split("/")[1], None)
    return list(names)


def headline_eval_key(records: Sequence[dict], name: str) -> str | None:
    """The score a set is judged by: greedy accuracy, else mean@n."""
    keys = {key for r in records for key in r if key.startswith(f"eval/{name}/")}
    if f"eval/{name}/accuracy" in keys:
        return f"eval/{name}/accuracy"
    return next(iter(sorted(k for k in keys if "/mean@" in k)), None)


def _eval_panel(ax: Axes, records: Sequence[dict], name: str, smooth: int) -> None:
    """Training reward (smoothed) and the set's eval scores on one axis (all are in [0, 1] for 0/1 rewards)."""
    reward = _series(records, "reward/mean")
    if reward is not None:
        ax.plot(reward[0], _smooth(reward[1], smooth), color="gray", alpha=0.7, label=f"train reward/mean (mean of {smooth})")
    prefix = f"eval/{name}/"
    keys = sorted({key for r in records for key in r if key.startswith(prefix)})
    shown = [k for k in keys if k.removeprefix(prefix) == "accuracy" or "@" in k.removeprefix(prefix)]
    for key in shown:
        series = _series(records, key)
        if series is not None:
            ax.plot(*series, marker="o", markersize=4, label=key.removeprefix(prefix))
    held = _series(records, f"{prefix}held_out")
    note = " (not held out)" if held is not None and not held[1][-1] else ""
    ax.set_title(f"eval: {name}{note}")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def eval_summary(records: Sequence[dict]) -> list[str]:
    """First / last / best score of each eval set, one line each."""
    lines = []
    for name in eval_sets(records):
        key = headline_eval_key(records, name)
        series = _series(records, key) if key else None
        if series is None:
            continue
        steps, values = series
        best = int(np.nanargmax(values))
        held = _series(records, f"eval/{name}/held_out")
        note = "; not held out (the eval covers the task's whole problem space)" if held is not None and not held[1][-1] else ""
        lines.append(
            f"{key}: first {values[0]:.4f} (step {steps[0]}) -> last {values[-1]:.4f} (step {steps[-1]}), "
            f"best {values[best]:.4f} (step {steps[best]}){note}"
        )
    return lines


def trained_steps(records: Sequence[dict]) -> list[dict]:
    """The records of training steps: the eval-only row of step 0 (before training) aside."""
    return [r for r in records if "reward/mean" in r or "perf/step_time" in r] or list(records)


def run_device(run_dir: Path, records: Sequence[dict]) -> str:
    """"GPU" or "CPU": the run's trainer.device (config.yaml); for "auto", whether the memory metrics that
    are logged on CUDA only are there."""
    config = run_dir / "config.yaml"
    device = "auto"
    if config.is_file():
        device = str((yaml.safe_load(config.read_text()) or {}).get("trainer", {}).get("device", "auto"))
    if device == "auto":
        on_cuda = any(key.startswith("perf/max_memory_allocated_gb/") for r in records for key in r)
        return "GPU" if on_cuda else "CPU"
    return "GPU" if device.startswith("cuda") else "CPU"


def summarize(records: Sequence[dict], k: int = 10) -> str:
    """One short paragraph: steps logged, first-k vs last-k mean reward, mean step time."""
    if not records:
        return "no metrics logged"
    trained = trained_steps(records)
    lines = [f"steps logged: {len(trained)} (step {trained[0]['step']} .. {trained[-1]['step']})"]
    reward = _series(records, "reward/mean")
    if reward is not None:
        values = reward[1]
        # Keep the two windows disjoint on short runs so the comparison means something.
        k = max(1, min(k, len(values) // 2))
        first, last = np.nanmean(values[:k]), np.nanmean(values[-k:])
        lines.append(f"reward/mean: first {k} steps {first:.4f} -> last {k} steps {last:.4f} ({last - first:+.4f})")
    else:
        lines.append("reward/mean: not logged")
    step_time = _series(records, "perf/step_time")
    if step_time is not None:
        lines.append(f"perf/step_time: mean {np.nanmean(step_time[1]):.3f} s")
    eval_time = _series(records, "perf/eval_time")
    if eval_time is not None:
        lines.append(f"perf/eval_time: {len(eval_time[1])} evals, {np.nansum(eval_time[1]):.1f} s in all")
    lines += eval_summary(records)
    return "\n".join(lines)


def write_report(run_dir: str | Path, k: int = 10, smooth: int = 10) -> Path:
    """Draw run_dir/report.png from run_dir/metrics.jsonl, print a text summary, return the path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    if not metrics_path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: not the run_dir of a slipstream run (trainer.run_dir)")
    records = read_metrics(metrics_path)

    # A bare Figure (no pyplot) renders through Agg without touching the global backend.
    names = eval_sets(records)
    eval_rows = -(-len(names) // 3)
    fig = Figure(figsize=(16, 9 + 4.5 * eval_rows), layout="constrained")
    axes = fig.subplots(2 + eval_rows, 3, squeeze=False)
    _line_panel(axes[0, 0], records, ["reward/mean"], "reward (mean)", smooth=smooth)
    _line_panel(axes[0, 1], records, ["actor/pg_loss", "actor/loss"], "policy loss")
    _line_panel(axes[0, 2], records, ["actor/kl"], "KL to reference")
    _line_panel(axes[1, 0], records, ["actor/entropy"], "entropy")
    _step_time_panel(axes[1, 1], records)
    _throughput_panel(axes[1, 2], records, run_device(run_dir, records))
    for i, ax in enumerate(axes[2:].flat):
        if i < len(names):
            _eval_panel(ax, records, names[i], smooth)
        else:
            ax.set_visible(False)
    fig.suptitle(f"{run_dir.name}: {len(trained_steps(records))} steps")

    out = run_dir / "report.png"
    fig.savefig(out, dpi=100)
    print(summarize(records, k=k))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write the report of each run directory given."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m slipstream.report RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    for run_dir in args:
        print(f"wrote {write_report(run_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
