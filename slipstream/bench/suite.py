"""`slipstream bench suite`: every benchmark the docs quote, as named entries; one results file per entry run.

    slipstream bench suite                  # the CPU entries, full size
    slipstream bench suite --gpu            # the GPU entries (skipped, with the reason, without CUDA)
    slipstream bench suite --quick          # every entry CPU-sized: a smoke test in seconds
    slipstream bench suite --gpu --only w1 --out docs/results/suite-2026-12-05 --resume --budget-s 540

An entry (the repository's benchmarks/suite_entries.py, found by checkout.py; `register` adds one) is a name,
a description, its rows and what it needs (CUDA, several GPUs). Each row is one measurement: on the GPU it runs in a fresh Python
process (an OOM or a hang cannot poison the next row), under a timeout; on the CPU and with
--quick in this process. Rows are written as they finish to OUT/<entry>.json (date, git commit,
source digest, GPU, torch, the exact command, the rows, and the entry's summary: ratios computed
only from rows of this file) and OUT/<entry>.md. `--resume` keeps the rows of an earlier run of
the same entry with the same commit, GPU, torch and size, and runs the rest; `--budget-s` stops
starting rows when the time left is below a row's estimate, so a long entry can be finished over
several device calls into the same file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from slipstream.bench.registry import REGISTRY, Entry, Row, gpu_count

SCHEMA = "slipstream.bench.suite/1"
PACKAGE = Path(__file__).resolve().parents[1]
"""The `slipstream` package directory (its sources are digested into every results file)."""


def _registry() -> dict[str, Entry]:
    """The entries, registered by the repository's benchmarks/suite_entries.py (BenchmarksNotFound without one)."""
    from slipstream.bench import checkout

    checkout.load("suite_entries")  # registers the entries
    return REGISTRY


# ---------------------------------------------------------------- selection and requirements


def select(names: list[str] | None, gpu: bool, quick: bool) -> list[tuple[Entry, set[str] | None]]:
    """(entry, row names or None for all) in registry order; --only takes `entry` or `entry/row`."""
    registry = _registry()
    if not names:
        wanted = ("cpu", "gpu", "any") if quick else (("gpu", "any") if gpu else ("cpu", "any"))
        return [(e, None) for e in registry.values() if e.device in wanted]
    chosen: dict[str, set[str] | None] = {}
    for name in names:
        entry, _, row = name.partition("/")
        if entry not in registry:
            raise ValueError(f"unknown suite entry {entry!r}; entries: {', '.join(registry)}")
        if row:
            if chosen.get(entry, set()) is not None:
                chosen.setdefault(entry, set()).add(row)  # type: ignore[union-attr]
        else:
            chosen[entry] = None
    return [(registry[name], chosen[name]) for name in registry if name in chosen]


def missing_requirement(entry: Entry, quick: bool, gpus: int) -> str | None:
    """Why the entry cannot run here, or None."""
    if quick:
        return None if entry.has_quick else "no CPU-sized version (it measures GPU kernels): run it with --gpu"
    if entry.device == "gpu" and gpus < entry.min_gpus:
        return f"needs {entry.min_gpus} CUDA GPU(s), found {gpus}"
    return None


# ---------------------------------------------------------------- results files


def source_digest() -> str:
    """sha256 over the slipstream package's .py files: names the tree that ran even where git cannot."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def run_meta(entry: Entry, quick: bool, command: str) -> dict:
    """What every results file records about where and how it was produced."""
    from slipstream.bench.train_step import env_info

    env = env_info()
    return {
        "schema": SCHEMA, "entry": entry.name, "description": entry.description, "quick": quick,
        "date": time.strftime("%Y-%m-%d"), "started": env["time"],
        "git_commit": os.environ.get("SLIPSTREAM_GIT_COMMIT") or env["git_commit"], "source_digest": source_digest(),
        "gpu": env["gpu"], "num_gpus": env["num_gpus"], "torch": env["torch"], "cuda": env["cuda"],
        "transformers": env["transformers"], "python": env["python"], "host": env["host"], "command": command,
        # other work on the machine skews CPU timings: the 1-minute load average when the entry started
        "load_avg_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(),
    }  # fmt: skip


_SAME_RUN = ("entry", "quick", "git_commit", "source_digest", "gpu", "torch")
"""Fields that must match for --resume to keep an earlier file's rows."""


def _kept_rows(path: Path, meta: dict) -> list[dict]:
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    differ = [k for k in _SAME_RUN if old.get(k) != meta.get(k)]
    if differ:
        raise ValueError(
            f"--resume: {path} was run with other {', '.join(differ)} "
            f"({', '.join(f'{k}={old.get(k)!r}' for k in differ)}); use a new --out directory"
        )
    return [r for r in old["rows"] if r.get("status") == "ok"]


def write_results(path: Path, meta: dict, rows: list[dict], entry: Entry) -> None:
    """Write OUT/<entry>.json (atomically: a crash keeps the previous version), OUT/<entry>.md and, where
    rows carry held-out eval curves, OUT/<entry>-eval.png."""
    from slipstream.bench.report import eval_curve_plot, suite_markdown

    summary = entry.summary(rows) if entry.summary else {}
    record = {**meta, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows, "summary": summary}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(path)
    path.with_suffix(".md").write_text(suite_markdown(record))
    figure = eval_curve_plot(rows)
    if figure is not None:
        figure.savefig(path.with_name(f"{path.stem}-eval.png"), dpi=110)


# ---------------------------------------------------------------- running rows


def run_row_here(row: Row) -> dict:
    """Run a row in this process; an exception becomes an "error" (or "oom") row."""
    start = time.perf_counter()
    try:
        result = row.run()
    except Exception as err:  # a suite is many independent measurements: one failure must not lose the rest
        status = "oom" if "out of memory" in str(err).lower() or type(err).__name__ == "OutOfMemoryError" else "error"
        tail = "".join(traceback.format_exception(err)[-3:])
        result = {"kind": "error", "status": status, "reason": f"{type(err).__name__}: {err}\n{tail}"[:4000]}
    return {"row": row.name, **result, "wall_s": time.perf_counter() - start}


_ROW_MARGIN_S = 30.0
"""Seconds a row keeps, after the commands it starts are stopped, to write its result."""


def run_row_in_child(entry: Entry, row: Row, quick: bool, timeout_s: float) -> dict:
    """Run a row in a fresh Python process (a new CUDA context), under a timeout."""
    start = time.perf_counter()
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"slipstream-suite-{os.getpid()}-{entry.name}-{row.name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "slipstream.bench.suite", "--child", entry.name, row.name, str(out)]
    cmd += ["--quick"] if quick else []
    # commands the row starts end by then, leaving the row time to write what they measured
    env = {**os.environ, "SLIPSTREAM_ROW_DEADLINE": str(time.time() + max(timeout_s - _ROW_MARGIN_S, timeout_s / 2))}
    if entry.allocator is not None:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", entry.allocator)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        tail = (stdout + stderr)[-3000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the row's process and what it started in its group
        stdout, stderr = proc.communicate()
        return {"row": row.name, "kind": "error", "status": "timeout", "reason": f"killed after {timeout_s:.0f} s",
                "output_tail": (stdout + stderr)[-3000:], "wall_s": time.perf_counter() - start}  # fmt: skip
    if not out.exists():
        return {"row": row.name, "kind": "error", "status": "crash", "reason": f"exit code {proc.returncode}\n{tail}",
                "wall_s": time.perf_counter() - start}  # fmt: skip
    result = json.loads(out.read_text())
    out.unlink()
    return {**result, "wall_s": time.perf_counter() - start, "cuda_alloc_conf": env.get("PYTORCH_CUDA_ALLOC_CONF")}


def _find_row(entry: Entry, name: str, quick: bool) -> Row:
    rows = {r.name: r for r in entry.rows(quick)}
    if name not in rows:
        raise ValueError(f"suite entry {entry.name!r} has no row {name!r}; rows: {', '.join(rows)}")
    return rows[name]


def run_entry(
    entry: Entry, rows_wanted: set[str] | None, quick: bool, out_dir: Path, command: str,
    resume: bool = False, deadline: float | None = None, log: Callable[[str], None] = print,
) -> Path:  # fmt: skip
    """Run one entry's rows (or the named ones) into OUT/<entry>.json; returns the file."""
    path = out_dir / f"{entry.name}.json"
    meta = run_meta(entry, quick, command)
    gpus = gpu_count()
    why = missing_requirement(entry, quick, gpus)
    if why:
        log(f"[suite] {entry.name}: skipped: {why}")
        write_results(path, {**meta, "status": "skipped", "reason": why}, [], entry)
        return path
    rows_all = entry.rows(quick)
    if rows_wanted:
        unknown = rows_wanted - {r.name for r in rows_all}
        if unknown:
            raise ValueError(f"suite entry {entry.name!r} has no rows {sorted(unknown)}")
    done = {r["row"]: r for r in _kept_rows(path, meta)} if resume else {}
    in_child = not quick and gpus > 0
    results = []
    for row in rows_all:
        if row.name in done:
            results.append(done[row.name])
            log(f"[suite] {entry.name}/{row.name}: kept from the earlier run")
            continue
        if rows_wanted and row.name not in rows_wanted:
            continue
        left = None if deadline is None else deadline - time.monotonic()
        if row.min_gpus > gpus:
            result = {"row": row.name, "kind": "skipped", "status": "skipped",
                      "reason": f"needs {row.min_gpus} GPUs, found {gpus}"}  # fmt: skip
        elif left is not None and left < row.estimate_s:
            result = {"row": row.name, "kind": "skipped", "status": "skipped",
                      "reason": f"--budget-s: {left:.0f} s left, the row takes about {row.estimate_s} s; "
                      "run the same command again with --resume"}  # fmt: skip
        elif in_child:
            timeout = max(3 * row.estimate_s, 120) if left is None else min(max(3 * row.estimate_s, 120), left)
            result = run_row_in_child(entry, row, quick, timeout)
        else:
            result = run_row_here(row)
        results.append(result)
        why = (str(result.get("reason") or "").splitlines() or [""])[0][:160]
        log(f"[suite] {entry.name}/{row.name}: {result['status']} in {result.get('wall_s', 0):.0f} s"
            + (f": {why}" if result["status"] != "ok" else ""))
        write_results(path, meta, results, entry)
    write_results(path, meta, results, entry)
    return path


def run_suite_command(args: argparse.Namespace) -> int:
    """Entry point of `slipstream bench suite`."""
    from slipstream.bench import checkout

    try:
        if args.benchmarks:
            checkout.use(args.benchmarks)
        registry = _registry()
    except ValueError as err:
        print(f"bench error: {err}", file=sys.stderr)
        return 2
    if args.list:
        for e in registry.values():
            minutes = sum(r.estimate_s for r in e.rows(False)) / 60
            need = f"{e.device}{f', {e.min_gpus}+ GPUs' if e.min_gpus > 1 else ''}, ~{minutes:.0f} min"
            print(f"{e.name:16s} [{need}] {e.description}")
        return 0
    try:
        chosen = select(args.only, args.gpu, args.quick)
    except ValueError as err:
        print(f"bench error: {err}", file=sys.stderr)
        return 2
    out = args.out or Path("bench_results") / f"suite-{time.strftime('%Y-%m-%d')}"
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    from slipstream.bench.train_step import command_line

    command = command_line()
    try:
        for entry, rows in chosen:
            path = run_entry(entry, rows, args.quick, out, command, args.resume, deadline)
            print(path.with_suffix(".md").read_text())
    except ValueError as err:
        print(f"bench error: {err}", file=sys.stderr)
        return 2
    print(f"results in {out}")
    return 0


def add_suite_parser(sub) -> None:
    """Register `bench suite` on the `bench` sub-parsers."""
    p = sub.add_parser("suite", help="run the named benchmarks the docs quote; one results file per entry")
    p.add_argument("--quick", action="store_true", help="CPU-sized versions of every entry (a smoke test in seconds)")
    p.add_argument("--gpu", action="store_true", help="the GPU entries (default: the CPU entries)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="entries (or ENTRY/ROW) to run, in any set")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench_results/suite-DATE)")
    p.add_argument("--resume", action="store_true",
                   help="keep the ok rows of OUT/<entry>.json from the same commit, GPU and torch; run the rest")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=None, help="start no row that would not finish in this time")
    p.add_argument("--list", action="store_true", help="list the entries and exit")
    p.add_argument("--benchmarks", type=Path, default=None, metavar="DIR",
                   help="the repository's benchmarks/ directory (default: the checkout holding slipstream, else "
                   "./benchmarks)")  # fmt: skip
    p.set_defaults(func=run_suite_command)


def _child(entry_name: str, row_name: str, out: str, quick: bool) -> None:
    entry = _registry()[entry_name]
    result = run_row_here(_find_row(entry, row_name, quick))
    Path(out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one suite row in a fresh process (used by run_row_in_child)")
    parser.add_argument("--child", nargs=3, metavar=("ENTRY", "ROW", "OUT"), required=True)
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    # The entries register into the imported module, not into this __main__ copy of it.
    from slipstream.bench import suite

    suite._child(*a.child, quick=a.quick)
