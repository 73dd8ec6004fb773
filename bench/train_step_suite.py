"""Train-step benchmark suite for one H200 (issue 3): slipstream vs the naive HF loop on W1.

    python bench/train_step_suite.py                 # everything, ~8 minutes
    python bench/train_step_suite.py --only w1-1.7b-cap16k,naive-1.7b
    OUT=/some/dir python bench/train_step_suite.py --budget-s 300

Each variant runs in its own Python process (a fresh CUDA context: an OOM or a hang in one
variant cannot poison the next) under a timeout taken from the remaining budget. A failed
or skipped variant is recorded with its error and the suite continues. Results go to
$OUT (default ./bench_out): one JSON per variant plus suite.json with all of them; the
summary table is printed LAST (and saved as suite.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPEATS, WARMUP = 3, 1
# Memory-curve points (tokens per micro-batch); AReaL #193 ran 30720 and OOMed at 61440.
CURVE_TOKENS = [16384, 32768, 49152, 65536, 98304, 131072]

# name -> (function, kwargs, timeout cap in seconds). Order = priority: the comparison the
# ">= 1.8x" goal needs comes first, then model sizes, then the slower / riskier variants.
VARIANTS: dict[str, tuple[str, dict, int]] = {
    # slipstream on W1 (qwen3-1.7b): the local backend (bf16 autocast over fp32 weights), FSDP2 at
    # world size 1 (bf16 params via MixedPrecisionPolicy, fp32 master + reduction), then + compile.
    "w1-1.7b-local-16k": ("train_step", dict(workload="W1", backend="local", max_tokens_per_mb=16384), 100),
    "w1-1.7b-fsdp-16k": ("train_step", dict(workload="W1", backend="fsdp", max_tokens_per_mb=16384), 100),
    "w1-1.7b-fsdp-32k-compile": (
        "train_step", dict(workload="W1", backend="fsdp", max_tokens_per_mb=32768, compile=True), 150,
    ),  # fmt: skip
    # closer to the naive loop's memory: selective / full recompute at the same budget
    "w1-1.7b-fsdp-32k-compile-sel": ("train_step", dict(workload="W1", backend="fsdp", max_tokens_per_mb=32768,
                                                        compile=True, activation_checkpointing="selective"), 150),
    "w1-1.7b-fsdp-32k-compile-full": ("train_step", dict(workload="W1", backend="fsdp", max_tokens_per_mb=32768,
                                                         compile=True, activation_checkpointing="full"), 150),
    # larger micro-batches: fewer, longer LM-head / weight-gradient passes (selective recompute to fit)
    "w1-1.7b-fsdp-64k-compile-sel": ("train_step", dict(workload="W1", backend="fsdp", max_tokens_per_mb=65536,
                                                        compile=True, activation_checkpointing="selective"), 150),
    "w1-1.7b-fsdp-48k-compile": ("train_step", dict(workload="W1", backend="fsdp", max_tokens_per_mb=49152,
                                                    compile=True), 150),
    "naive-1.7b": ("naive", dict(workload="W1", micro_batch_size=4), 150),
    "logprob-65536x151936": ("logprob", dict(num_tokens=65536, vocab_size=151936, hidden_size=2048), 60),
    "memcurve-1.7b": ("memory_curve", dict(preset="qwen3-1.7b", tokens_per_mb_list=CURVE_TOKENS, backend="fsdp",
                                           activation_checkpointing="full"), 120),
    "w1-0.6b-fsdp-compile": ("train_step", dict(workload="W1-0.6b", backend="fsdp", max_tokens_per_mb=32768, compile=True), 100),
    "w1-4b-fsdp-compile": ("train_step", dict(workload="W1-4b", backend="fsdp", max_tokens_per_mb=32768, compile=True,
                                              activation_checkpointing="selective"), 150),
    # fp32 master weights + grads + AdamW of 8B are ~122 GiB: expected to OOM on one GPU
    # (recorded as such); the real 8B number needs --backend fsdp over >= 2 GPUs.
    "w1-8b-fsdp": ("train_step", dict(workload="W1-8b", backend="fsdp", max_tokens_per_mb=16384,
                                      activation_checkpointing="full"), 120),
    "w1-8b-fsdp-8k": ("train_step", dict(workload="W1-8b", backend="fsdp", max_tokens_per_mb=8192,
                                         activation_checkpointing="full", repeats=2), 150),
}
NAIVE_FALLBACK_MBS = 2  # when 4 padded sequences per micro-batch do not fit
SMOKE_ENV = "SLIPSTREAM_SUITE_SMOKE"


def _smoke_kwargs(kind: str, kwargs: dict) -> dict:
    """--smoke: the same plumbing on tiny CPU shapes (checks the suite, measures nothing)."""
    import torch

    if kind == "train_step":
        return {**kwargs, "workload": "tiny", "max_tokens_per_mb": 128, "dtype": torch.float32, "device": "cpu"}
    if kind == "naive":
        return {**kwargs, "workload": "tiny", "micro_batch_size": 3, "dtype": torch.float32, "device": "cpu"}
    if kind == "logprob":
        return dict(num_tokens=512, vocab_size=1000, hidden_size=32, dtype=torch.float32, device="cpu")
    return dict(preset="tiny", tokens_per_mb_list=[64, 128], seq_len=64, dtype=torch.float32, device="cpu")


def run_variant(name: str) -> dict:
    """Run one variant in this process (the child side)."""
    import torch

    from slipstream.bench import naive, train_step

    kind, kwargs, _ = VARIANTS[name]
    if os.environ.get(SMOKE_ENV) == "1":
        kwargs = _smoke_kwargs(kind, kwargs)
    if kind == "train_step":
        return train_step.bench_train_step(**{"repeats": REPEATS, "warmup": WARMUP, **kwargs})
    if kind == "naive":
        try:
            return naive.bench_naive(repeats=REPEATS, warmup=WARMUP, **kwargs)
        except torch.OutOfMemoryError as err:
            first = str(err).splitlines()[0]
            torch.cuda.empty_cache()
            kwargs = {**kwargs, "micro_batch_size": NAIVE_FALLBACK_MBS}
            result = naive.bench_naive(repeats=REPEATS, warmup=WARMUP, **kwargs)
            result["note"] = f"micro_batch_size 4 ran out of memory ({first}); used {NAIVE_FALLBACK_MBS}"
            return result
    if kind == "logprob":
        return train_step.logprob_memory_check(**kwargs)
    if kind == "memory_curve":
        return train_step.memory_curve(**kwargs)
    raise AssertionError(f"unknown variant kind {kind}")


def _child(name: str, out_file: Path) -> int:
    try:
        result = run_variant(name)
        result["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - the suite records any failure and goes on
        import torch

        status = "oom" if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err) else "error"
        result = {"status": status, "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    result["variant"] = name
    result["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    out_file.write_text(json.dumps(result, indent=2))
    return 0


def _launch(name: str, out_dir: Path, timeout: float) -> dict:
    out_file = out_dir / f"{name}.json"
    out_file.unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--child-out", str(out_file)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"") + (err.stderr or b"")
        tail = (out.decode(errors="replace") if isinstance(out, bytes) else out)[-1500:]
        proc = None
    wall = time.monotonic() - start
    if out_file.exists():
        result = json.loads(out_file.read_text())
    elif proc is None:
        result = {"variant": name, "status": "timeout", "error": f"killed after {timeout:.0f} s", "log_tail": tail}
    else:
        result = {"variant": name, "status": "crash", "error": f"exit code {proc.returncode}", "log_tail": tail}
    result["wall_s"] = wall
    out_file.write_text(json.dumps(result, indent=2))
    print(f"[suite] {name}: {result['status']} in {wall:.0f} s", flush=True)
    if result["status"] != "ok":
        print(f"[suite]   {result.get('error', '')[:300]}", flush=True)
    return result


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _summary(results: dict[str, dict]) -> str:
    """Short fixed-width table: one line per variant, speed-up vs the naive baseline."""
    naive = results.get("naive-1.7b", {})
    naive_tps = naive["phases"]["actor_train"]["tok_per_s"] if naive.get("status") == "ok" else None
    lines = [f"{'variant':<22} {'status':<8} {'#mb':>4} {'train s':>8} {'tok/s':>9} {'TFLOP/s':>8} "
             f"{'MFU':>6} {'GiB':>6} {'logp s':>7} {'vs naive':>8}"]  # fmt: skip
    for name, r in results.items():
        if r.get("status") != "ok" or "phases" not in r:
            detail = ""
            if r.get("kind") == "memory_curve":
                detail = f"largest fitting micro-batch: {r['largest_fitting_tokens']} tokens"
            elif r.get("kind") == "logprob_memory":
                detail = (f"extra peak {_num(r['extra_peak_gib'], '.2f')} GiB (fp32 logits would be "
                          f"{r['naive_logits_fp32_gib']:.1f}), {r['time_s']:.3f} s, err {r['max_abs_err_vs_fp64']:.1e}")  # fmt: skip
            lines.append(f"{name:<22} {r.get('status', '?'):<8} {detail}")
            continue
        t = r["phases"]["actor_train"]
        f = r["phases"].get("log_probs")
        same_model = r["workload"]["preset"] == "qwen3-1.7b"
        speedup = f"{t['tok_per_s'] / naive_tps:.2f}x" if naive_tps and same_model else "-"
        mfu, gib = _num(t["mfu"], ".1%"), _num(t["peak_memory_gib"], ".1f")
        logp = f"{f['time_s']:.3f}" if f else "-"
        lines.append(f"{name:<22} {'ok':<8} {r['micro_batches']['count']:>4} {t['time_s']:>8.3f} "
                     f"{t['tok_per_s']:>9,.0f} {t['tflops']:>8.1f} {mfu:>6} {gib:>6} {logp:>7} {speedup:>8}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all, in order)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole suite")
    parser.add_argument("--list", action="store_true", help="print the variant names and exit")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes: check the plumbing only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return _child(args.child, args.child_out)
    if args.list:
        print("\n".join(VARIANTS))
        return 0
    names = list(VARIANTS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; available: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.smoke:
        os.environ[SMOKE_ENV] = "1"  # inherited by the child processes
    out_dir = Path(os.environ.get("OUT", "bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    results: dict[str, dict] = {}
    for name in names:
        remaining = deadline - time.monotonic()
        if remaining < 20:  # not enough left to even start a model
            results[name] = {"variant": name, "status": "skipped", "error": "suite time budget spent"}
            continue
        results[name] = _launch(name, out_dir, timeout=min(VARIANTS[name][2], remaining))
    (out_dir / "suite.json").write_text(json.dumps(results, indent=2))
    try:
        table = _summary(results)
    except (KeyError, TypeError, ValueError) as err:  # never lose the run over the table
        table = f"(summary failed: {err!r})\n" + "\n".join(f"{n}: {r.get('status')}" for n, r in results.items())
    (out_dir / "suite.txt").write_text(table + "\n")
    print(f"\nresults in {out_dir.resolve()}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
