"""Report of a benchmark matrix: a markdown table plus three PNGs, drawn from its results JSONL.

  matrix.md      environment, the result table (each row with its own engine, precision, compile,
                 recompute, micro-batching and padding; real-token speed-up over the best TRL row of
                 the same workload), unmeasured cells with their reasons, and the fairness
                 checklist of every measured cell
  phases.png     time per phase (actor update stacked on the log-prob pass) per cell
  mfu.png        actor-update MFU per cell
  memory.png     peak memory of each phase per cell

An rl-step matrix (rl_step.py) gets its own header and table (step, rollout and train time,
train TFLOP/s and MFU, tok/s per GPU, wait-time ratio, peak memory per phase on CUDA); the
plots then stack the phases of a whole step.

Figures are built with `matplotlib.figure.Figure` (Agg canvas, no pyplot state), so this
runs headless. Cells that were not measured appear on the plots' axes with their status.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from slipstream.bench.rows import read_rows

PHASES = ("actor_train", "log_probs")
_GIB_NONE = "-"


def _fmt(value, spec: str) -> str:
    return _GIB_NONE if value is None else format(value, spec)


def _cell_label(row: dict) -> str:
    return f"{row['workload']['name']}\n{row.get('row') or row['framework'] + '-' + row['backend']}"


def best_rows(rows: Sequence[dict], framework: str) -> dict[str, dict]:
    """Per workload, the measured row of `framework` with the highest real-token throughput."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["framework"] == framework and r["status"] == "ok":
            name = r["workload"]["name"]
            if name not in best or _tok_per_s(r) > _tok_per_s(best[name]):
                best[name] = r
    return best


def _tok_per_s(row: dict) -> float:
    return row["phases"]["actor_train"]["tok_per_s"]


def _speedup_vs_trl(rows: Sequence[dict]) -> list[float | None]:
    """Per row: real-token throughput over the best TRL row of the same workload (None: not measured / no TRL)."""
    trl = {name: _tok_per_s(r) for name, r in best_rows(rows, "trl").items()}
    return [
        _tok_per_s(r) / trl[r["workload"]["name"]] if r["status"] == "ok" and r["workload"]["name"] in trl else None
        for r in rows
    ]


def _name(row: dict) -> str:
    """How tables name a row: its suite row name, else its matrix cell."""
    return row.get("row") or row["cell"]


def _same(rows: Sequence[dict], get) -> object | None:
    """The value `get(row)` when every row has the same one, else None (then each row states its own)."""
    values = {repr(get(r)) for r in rows}
    return get(rows[0]) if len(values) == 1 else None


def row_settings(r: dict) -> list[str]:
    """A row's own settings as table cells: engine (processes), dtype / params, compile, recompute, micro-batching."""
    f = r.get("fairness") or {}
    engine = f"{r['backend']}: {f['engine']}" if f.get("engine") else r["backend"]
    return [
        f"{engine} ({f.get('processes', '?')} proc.)",
        f"{f.get('dtype', '-')} / {f.get('params_dtype', '-')}",
        str(f.get("compile", "-")),
        str(f.get("recompute", "-")),
        str(f.get("micro_batching", "-")),
    ]


SETTINGS_HEAD = "| engine (processes) | dtype / params | compile | recompute | micro-batching |"


def markdown_table(rows: Sequence[dict]) -> str:
    """The matrix as markdown: header facts, result table (each row with its own settings), reasons, fairness."""
    if not rows:
        raise ValueError("no result rows to report")
    if rows[0]["mode"] == "rl-step":
        from slipstream.bench.rl_step import rl_step_markdown

        return "\n".join(rl_step_markdown(rows) + _unmeasured_and_fairness(rows)) + "\n"
    env = rows[0]["env"]
    peers = env.get("peers", {})
    peer_text = ", ".join(f"{k} {v}" for k, v in peers.items() if v) or "none installed"
    peak = _same(rows, lambda r: r["held_constant"].get("peak_flops"))
    timing = _same(rows, lambda r: (r["held_constant"]["warmup"], r["held_constant"]["repeats"]))
    lines = [
        "# Benchmark matrix",
        "",
        f"- Device: {env.get('gpu') or 'CPU'} x{max(env.get('num_gpus') or 0, 1)}; torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, CUDA {env.get('cuda')}, Python {env.get('python')}",
        f"- Peers: {peer_text}",
        f"- Commit: `{env.get('git_commit')}`; recorded {env.get('time')}",
        f"- Command: `{env.get('command')}`",
        "- Timing: " + (f"warm-up {timing[0]} + {timing[1]} timed repeats" if timing else "warm-up + repeats per row")
        + " (median, min-max); each row states its own engine, precision, compile, recompute, micro-batching and "
        "padding (details in the fairness checklist below)",
        f"- Tokens are real tokens (padding excluded); FLOPs are model FLOPs (docs/architecture.md#tokens-flops-and-mfu); MFU against "
        f"{'an override peak of %.0f TFLOP/s' % (peak / 1e12) if peak else 'the datasheet dense bf16 peak'}; "
        "noise = (max - min) / median of the actor update; vs TRL = real tok/s over the best TRL row of the "
        "same workload",
        "",
    ]
    lines += matrix_table_lines(rows)
    return "\n".join(lines + _unmeasured_and_fairness(rows)) + "\n"


def matrix_table_lines(rows: Sequence[dict]) -> list[str]:
    """The result table of train-step matrix rows, each with its own settings, and the best TRL row named."""
    lines = [
        "| workload | framework | status " + SETTINGS_HEAD + " padding | update s (min-max) | noise | real tok/s "
        "| vs TRL | TFLOP/s | MFU | peak GiB | log-prob s | log-prob GiB |",
        "|---" * 18 + "|",
    ]
    for r, speedup in zip(rows, _speedup_vs_trl(rows), strict=True):
        wl = r["workload"]
        head = f"| {wl['name']} ({wl['preset']}) | {r.get('row') or r['framework']} | {r['status']} |"
        if r["status"] != "ok":
            lines.append(head + f" {r['backend']} |" + " - |" * 14)
            continue
        t, f = r["phases"]["actor_train"], r["phases"].get("log_probs")
        fair = r.get("fairness") or {}
        lines.append(
            head + "".join(f" {c} |" for c in row_settings(r))
            + f" {_fmt(fair.get('padding_fraction'), '.1%')} "
            f"| {t['time_s']:.3f} ({t['time_min_s']:.3f}-{t['time_max_s']:.3f}) | {t['rel_spread']:.1%} "
            f"| {t['tok_per_s']:,.0f} | {_fmt(speedup, '.2f')}x | {t['tflops']:.1f} "
            f"| {_fmt(t['mfu'], '.1%')} | {_fmt(t['peak_memory_gib'], '.1f')} "
            f"| {_fmt(f['time_s'] if f else None, '.3f')} | {_fmt(f['peak_memory_gib'] if f else None, '.1f')} |"
        )
    best = best_rows(rows, "trl")
    if best:
        lines += ["", "Best TRL row per workload: " + "; ".join(
            f"{name}: `{_name(r)}` (recompute {r['fairness']['recompute']})" for name, r in best.items()
        )]  # fmt: skip
    return lines


def _unmeasured_and_fairness(rows: Sequence[dict]) -> list[str]:
    """The reasons of the cells without numbers, then the fairness checklist of the measured ones."""
    lines: list[str] = []
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        lines += ["", "## Cells without numbers", ""]
        for r in skipped:
            reason = (r.get("reason") or "").splitlines()[0] if r.get("reason") else ""
            install = f" Install: `{r['install']}`" if r.get("install") else ""
            lines.append(f"- `{_name(r)}` **{r['status']}**: {reason}{install}")
    measured = [r for r in rows if r["status"] == "ok" and r.get("fairness")]
    if measured:
        keys = list(measured[0]["fairness"])
        lines += ["", "## Fairness checklist", "", "| cell | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for r in measured:
            cells = [_fmt(v, ".1%") if k == "padding_fraction" else str(v) for k, v in r["fairness"].items()]
            lines.append(f"| {_name(r)} | " + " | ".join(cells) + " |")
    return lines


def _phases(rows: Sequence[dict]) -> tuple[str, ...]:
    """The phases the plots show: train-step's two, or those of an rl-step that some cell measured."""
    if rows[0]["mode"] != "rl-step":
        return PHASES
    from slipstream.bench.rl_step import RL_PHASES

    return tuple(p for p in RL_PHASES if any(r["status"] == "ok" and p in r["phases"] for r in rows))


def _bar_figure(rows: Sequence[dict], title: str, ylabel: str) -> tuple[Figure, object, list[str]]:
    fig = Figure(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    labels = [_cell_label(r) for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig, ax, labels


def _mark_unmeasured(ax, rows: Sequence[dict], missing_value: Sequence[bool] | None = None) -> None:
    # Cells without a bar say why on the axis instead of silently showing nothing.
    for i, r in enumerate(rows):
        if r["status"] != "ok" or (missing_value is not None and missing_value[i]):
            text = r["status"] if r["status"] != "ok" else "n/a"
            ax.text(i, 0, text, ha="center", va="bottom", rotation=90, fontsize=8, color="gray")


def phase_plot(rows: Sequence[dict]) -> Figure:
    """Stacked per-phase median time per cell."""
    fig, ax, _ = _bar_figure(rows, "Time per phase (median)", "seconds")
    bottom = [0.0] * len(rows)
    for phase in _phases(rows):
        heights = [
            r["phases"][phase]["time_s"] if r["status"] == "ok" and phase in r["phases"] else 0.0 for r in rows
        ]
        ax.bar(range(len(rows)), heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.legend()
    _mark_unmeasured(ax, rows)
    return fig


def mfu_plot(rows: Sequence[dict]) -> Figure:
    """Actor-update MFU per cell (n/a where no peak FLOP/s is known, e.g. the CPU)."""
    fig, ax, _ = _bar_figure(rows, "Actor update MFU", "MFU (%)")
    values = [r["phases"]["actor_train"]["mfu"] if r["status"] == "ok" else None for r in rows]
    ax.bar(range(len(rows)), [100 * v if v is not None else 0.0 for v in values])
    _mark_unmeasured(ax, rows, [v is None for v in values])
    return fig


def memory_plot(rows: Sequence[dict]) -> Figure:
    """Peak memory of each phase per cell (n/a where not measured, e.g. the CPU)."""
    fig, ax, _ = _bar_figure(rows, "Peak memory per phase", "GiB")
    phases = _phases(rows)
    width = 0.8 / max(len(phases), 1)
    absent = [True] * len(rows)
    for k, phase in enumerate(phases):
        values = []
        for i, r in enumerate(rows):
            v = r["phases"][phase]["peak_memory_gib"] if r["status"] == "ok" and phase in r["phases"] else None
            absent[i] = absent[i] and v is None
            values.append(0.0 if v is None else v)
        ax.bar([i + (k - (len(phases) - 1) / 2) * width for i in range(len(rows))], values, width, label=phase)
    ax.legend()
    _mark_unmeasured(ax, rows, absent)
    return fig


def write_matrix_report(results_jsonl: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Write matrix.md, phases.png, mfu.png and memory.png for a results JSONL; returns their paths."""
    rows = read_rows(results_jsonl)
    if not rows:
        raise ValueError(f"{results_jsonl} has no result rows")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "matrix.md"} | {name: out / f"{name}.png" for name in ("phases", "mfu", "memory")}
    paths["markdown"].write_text(markdown_table(rows))
    for name, plot in (("phases", phase_plot), ("mfu", mfu_plot), ("memory", memory_plot)):
        plot(rows).savefig(paths[name], dpi=110)
    return paths


# ---------------------------------------------------------------- suite results files (suite.py)


def _generation_text(x: dict) -> str:
    """One `slipstream bench rollout` row: engine, case, call, tok/s and, where measured, bound and breakdown."""
    from slipstream.bench.rollout import decode_idle

    parts = [f"{x.get('engine')} {x.get('case')} {x.get('call')}: {x['tok_per_s']:,.0f} tok/s"]
    if x.get("bound_frac") is not None:
        parts.append(f"{x['bound_frac']:.1%} of the bound")
    if x.get("ms_per_decode_step") is not None:
        parts.append(f"{x['time_s']:.2f} s, prefill {x['prefill_s']:.2f} s, "
                     f"{x['ms_per_decode_step']:.2f} ms per decode step")  # fmt: skip
    idle = decode_idle(x)
    if idle is not None:
        parts.append(f"device idle {idle:.1%} of the decode")
    launch = (x.get("settings") or {}).get("decode_launch")
    if launch and x.get("call") == "first":
        parts.append("decode launch " + ",".join(str(v) for v in launch.values())
                     + f", {x['settings'].get('programs_per_sm')} programs per SM")  # fmt: skip
    return " (".join([parts[0], ", ".join(parts[1:])]) + ")" if len(parts) > 1 else parts[0]


def suite_markdown(record: dict) -> str:
    """OUT/<entry>.md of a suite results file: where it ran, the rows (each with its settings), the summary."""
    lines = [
        f"# {record['entry']}: {record['description']}",
        "",
        f"- Date {record['date']}; commit `{record['git_commit']}` (source digest `{record['source_digest']}`)",
        f"- Device: {record['gpu'] or 'CPU'} x{max(record['num_gpus'] or 0, 1)}; torch {record['torch']}, CUDA "
        f"{record['cuda']}, transformers {record['transformers']}, Python {record['python']}; load average "
        f"{record.get('load_avg_1m', float('nan')):.1f} on {record.get('cpu_count')} CPUs at the start",
        f"- Command: `{record['command']}`" + (" (--quick: CPU-sized, a smoke test that measures nothing)"
                                               if record["quick"] else ""),  # fmt: skip
    ]
    if record.get("status") == "skipped":
        return "\n".join([*lines, "", f"Skipped: {record['reason']}"]) + "\n"
    rows = record["rows"]
    matrix = [r for r in rows if r.get("kind") == "matrix"]
    if matrix and matrix[0]["mode"] == "rl-step":
        from slipstream.bench.rl_step import rl_step_markdown

        # its settings lines; device, commit and command are in this file's header already
        lines += [""] + [line for line in rl_step_markdown(matrix)[2:] if not line.startswith(("- Device", "- Commit",
                                                                                               "- Command"))]  # fmt: skip
    elif matrix:
        lines += ["", *matrix_table_lines(matrix)]
    others = [r for r in rows if r.get("kind") != "matrix"]
    if others:
        lines += [""] + [f"- `{r['row']}` {_other_row_text(r)}" for r in others]
    ratios = (record.get("summary") or {}).get("ratios") or []
    if ratios:
        lines += ["", "## Ratios (both rows from this file)", ""]
        for q in ratios:
            (a, b), (ra, rb), (pa, pb) = q["rows"], q["recompute"], q["peak_gib"]
            lines.append(
                f"- {q['what']}: **{q['ratio']:.2f}x** (`{a}` {q['tok_per_s'][0]:,.0f} vs `{b}` {q['tok_per_s'][1]:,.0f} "
                f"real tok/s; recompute {ra} / {rb}; peak {_fmt(pa, '.1f')} / {_fmt(pb, '.1f')} GiB)"
            )
    scalars = {k: v for k, v in (record.get("summary") or {}).items() if isinstance(v, (int, float))}
    if scalars:
        lines += ["", "## Summary (from this file's rows)", "", *(f"- `{k}`: {v:.3f}" for k, v in scalars.items())]
    return "\n".join(lines + _unmeasured_and_fairness(matrix)) + "\n"


def eval_curve_plot(rows: Sequence[dict]) -> Figure | None:
    """Held-out greedy accuracy against the run's wall time, one line per row and eval set (train_eval rows,
    including partial curves of runs that ended early); None where no row has a curve."""
    curves = [r for r in rows if r.get("eval_curve")]
    if not curves:
        return None
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.add_subplot()
    for r in curves:
        sets = [k for k in r["eval_curve"][0] if k not in ("step", "elapsed_s")]
        for name in sets:
            points = [(p["elapsed_s"], p[name]) for p in r["eval_curve"] if name in p]
            style = "-o" if r["status"] == "ok" else "--x"
            ax.plot(*zip(*points), style, markersize=3, label=f"{r['row']}: {name}" + ("" if r["status"] == "ok" else
                                                                                         f" ({r['status']})"))
    ax.set_xlabel("seconds since the run started (evals included)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _eval_curve_text(r: dict) -> str:
    """step (seconds since the run started): accuracy per set, for each eval of a train_eval row."""
    return "; ".join(f"step {p['step']} ({p['elapsed_s']:.0f} s): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in p.items() if k not in ("step", "elapsed_s"))
                     for p in r["eval_curve"])  # fmt: skip


def _other_row_text(r: dict) -> str:
    """One line for a row that is not a matrix cell (an op, a curve, a command, a whole run)."""
    if r["status"] != "ok":
        reason = (str(r.get("reason") or "").strip().splitlines() or [""])[0]
        tail = (str(r.get("output_tail") or "").strip().splitlines() or [""])[-1]
        curve = f"; evals logged before it ended: {_eval_curve_text(r)}" if r.get("eval_curve") else ""
        return f"**{r['status']}**: {reason or tail}{curve}"
    kind = r.get("kind")
    if kind == "train_eval":
        gains = ", ".join(f"{name} {r['before'][name]:.3f} -> {r['after'][name]:.3f} ({g:+.1f} points, "
                          f"{_fmt(r['eval_problems'].get(name), '.0f')} problems"
                          f"{'' if r.get('held_out', {}).get(name, True) else ', not held out'})"
                          for name, g in r["gain_points"].items())  # fmt: skip
        train = ""
        if r.get("step_time_median_s"):
            train = (f"; step time median {r['step_time_median_s']:.3f} s, {r['samples_per_hour']:,.0f} samples/h, "
                     f"trainer wait {_fmt(r['trainer_wait_ratio'], '.1%')}, staleness mean "
                     f"{_fmt(r['staleness_mean'], '.2f')}")  # fmt: skip
        return (f"{r['wall_s']:.0f} s in all, {r['steps']} steps{train}. Greedy eval accuracy, before -> after: "
                f"{gains}. Curve: {_eval_curve_text(r)}")  # fmt: skip
    if kind == "logprob_op":
        return (f"fused log-prob{' + entropy' if r['with_entropy'] else ''} at {r['num_tokens']:,} tokens x "
                f"{r['vocab_size']:,} vocab (hidden {r['hidden_size']}, {r['dtype']}): extra peak "
                f"{_fmt(r['extra_peak_gib'], '.2f')} GiB beyond inputs (fp32 logits alone: "
                f"{r['naive_logits_fp32_gib']:.1f} GiB), {r['time_s']:.3f} s fwd+bwd, max |err| vs fp64 "
                f"{r['max_abs_err_vs_fp64']:.1e}")  # fmt: skip
    if kind == "memory_curve":
        points = ", ".join(f"{p['tokens']:,}: {_fmt(p['peak_memory_gib'], '.1f')} GiB" if p["status"] == "ok"
                           else f"{p['tokens']:,}: {p['status']}" for p in r["points"])  # fmt: skip
        return f"{r['preset']}, {r['backend']}, recompute {r['activation_checkpointing']}: {points}"
    if kind == "plan_balance":
        plans = "; ".join(f"{p['ranks']} ranks: {p['micro_batches_per_rank']} mb/rank, tokens/rank "
                          f"{p['tokens_min']:,}-{p['tokens_max']:,}, work max/mean {p['work_max_over_mean']:.6f}"
                          for p in r["plans"])  # fmt: skip
        return f"{r['workload']} x K on K ranks, budget {r['max_tokens_per_mb']:,}: {plans}"
    if kind == "train":
        return (f"{r['steps']} steps: reward/mean {r['reward_first10']:.3f} (first 10) -> {r['reward_last10']:.3f} "
                f"(last 10); step time median {r['step_time_median_s']:.3f} s, mean {r['step_time_mean_s']:.3f} s")  # fmt: skip
    if kind == "command":
        measured = [x for x in (r.get("data") or {}).get("rows", []) if isinstance(x, dict) and "tok_per_s" in x]
        if not measured:
            return f"ok: `{r['command']}` (output and data in the JSON)"
        return f"ok: `{r['command']}`; " + "; ".join(_generation_text(x) for x in measured)
    if kind == "rl_run":
        return (f"{r['steps_timed']} timed steps: step time median {r['step_time_median_s']:.3f} s, "
                f"{r['samples_per_hour']:,.0f} samples/h, trainer wait {_fmt(r['trainer_wait_ratio'], '.1%')}, "
                f"rollout wait {_fmt(r['rollout_wait_ratio'], '.1%')}, staleness mean {_fmt(r['staleness_mean'], '.2f')} "
                f"(max {r['staleness_max']:.0f}), weight sync {_fmt(r['weight_sync_s'], '.3f')} s")  # fmt: skip
    return f"{r['status']}"

