"""`slipstream bench train-step`, `bench matrix` and `bench suite`: argument parsing (light) and result tables.

Only argparse runs at import time; torch, transformers and the benchmarks are imported
inside the command, so `slipstream --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _backend(text: str) -> str:
    from slipstream.config.schema import parse_backend  # dataclasses only: cheap at parse time

    try:
        parse_backend(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` with its `train-step`, `matrix` and `suite` sub-commands on the top-level subparsers."""
    bench = subparsers.add_parser("bench", help="measure the training step (and baselines) on fixed workloads")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("train-step", help="time the actor update and log-prob pass of one workload")
    p.add_argument("--workload", default="W1", help="named workload: W1, W1-0.6b, W1-4b, W1-8b, tiny (default W1)")
    p.add_argument("--preset", default=None, help="run the workload's lengths on another model preset")
    p.add_argument("--scale", type=int, default=1,
                   help="K x the workload's prompts, same length distribution: under torchrun with K ranks each "
                   "rank gets the work of one (weak scaling; default 1)")  # fmt: skip
    p.add_argument("--backend", type=_backend, default="local",
                   help="local, fsdp, megatron or megatron:d<D>t<T>p<P>c<C> (default local)")  # fmt: skip
    p.add_argument("--max-tokens-per-mb", type=int, default=16384, help="micro-batch token budget (default 16384)")
    p.add_argument("--ac", choices=("none", "selective", "full"), default="none", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    p.add_argument("--master-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameters, gradients and AdamW state: float32 (16 B/param) or bfloat16 (8 B/param, "
                   "stochastic rounding); see actor.master_dtype")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="timed repeats after the warm-up (default 5)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs before the timed repeats (compile, allocator and autotuning warm-up; default 1)")  # fmt: skip
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    p.add_argument("--peak-flops", type=float, default=None, help="override the dense bf16 peak FLOP/s for MFU")
    p.add_argument("--naive", action="store_true", help="also run the naive HF baseline on the same workload")
    p.add_argument("--naive-mbs", type=int, default=4, help="sequences per padded micro-batch of the naive baseline")
    p.add_argument("--memory-curve", type=_int_list, default=None, metavar="N1,N2,...",
                   help="also measure peak memory of one fwd+bwd micro-batch of each token count")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write all results as one JSON object here")
    p.set_defaults(func=run_train_step)
    m = sub.add_parser("matrix", help="run a {workload} x {framework} x {backend} matrix from a YAML spec")
    m.add_argument("spec", type=Path, help="matrix spec YAML (see benchmarks/specs/matrix_w1.yaml)")
    m.add_argument("--out", type=Path, default=Path("bench_results/matrix"),
                   help="directory for results.jsonl, matrix.md and the PNGs (default bench_results/matrix)")  # fmt: skip
    m.add_argument("--report-only", action="store_true", help="redraw the report from OUT/results.jsonl, run nothing")
    m.add_argument("--benchmarks", type=Path, default=None, metavar="DIR",
                   help="the repository's benchmarks/ (the trl and verl adapters; default: the checkout holding "
                   "slipstream, else ./benchmarks)")  # fmt: skip
    m.add_argument("--resume", action="store_true",
                   help="keep the rows already in OUT/results.jsonl for this spec and run only the missing cells")  # fmt: skip
    m.set_defaults(func=run_matrix_command)
    add_rollout_parser(sub)
    from slipstream.bench.suite import add_suite_parser  # argparse and the standard library only at import

    add_suite_parser(sub)
    return p


def add_rollout_parser(sub) -> None:
    """Register `slipstream bench rollout` on the bench sub-parsers."""
    p = sub.add_parser("rollout", help="generation speed of the builtin engine vs the memory-bandwidth bound")
    p.add_argument("--preset", default="qwen3-1.7b", help="model preset with random weights (default qwen3-1.7b)")
    p.add_argument("--workload", choices=("fixed", "w1", "nanovllm"), default="fixed",
                   help="fixed: --batch x --prompt-len + --new-tokens; w1: W1's budgets; nanovllm: nano-vllm's bench")
    p.add_argument("--batch", default="64,256", help="comma-separated samples per call, fixed workload (default 64,256)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group), fixed workload")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--peer", action="append", default=[], choices=("hf",),
                   help="also run transformers generate (dynamic cache; static cache + compile) on the same prompts")
    p.add_argument("--decode-attention", default="triton",
                   help="comma-separated decode kernels to compare in one run: triton, flash (default triton)")
    p.add_argument("--peer-batch", default=None, help="comma-separated batch sizes the peer runs (default: all)")
    p.add_argument("--decode-launch", default=None,
                   help="the Triton decode kernel's launch, block_n,num_warps,num_stages[,heads_first[,longest_first]] "
                   "(rollout.decode_launch; default: ops/decode_attention.py:LAUNCH)")  # fmt: skip
    p.add_argument("--decode-programs-per-sm", type=int, default=None,
                   help="split programs per SM the decode kernel aims for (rollout.decode_programs_per_sm, default 8)")
    p.add_argument("--steps-per-sync", type=int, default=16,
                   help="decode steps between two looks of the host at the tokens (rollout.decode_steps_per_sync)")
    p.add_argument("--no-overlap-decode", action="store_true",
                   help="read each ring of decode steps before queueing the next (rollout.overlap_decode=false)")
    p.add_argument("--no-layer-kernels", action="store_true",
                   help="the element-wise work between the layers' GEMMs in compiled torch code, not the Triton kernels "
                   "of ops/layer_kernels.py")
    p.add_argument("--fused-lm-head", action="store_true",
                   help="sample with the LM head inside the sampling kernel (ops/sampling.py:sample_hidden)")
    p.add_argument("--no-compile", action="store_true", help="eager layer halves (CUDA graphs still on)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="launch every decode step from the host")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="write rows + environment as JSON here")
    p.add_argument("--profile", default=None, help="profile one more call of the first case; kernel table to this file")
    p.add_argument("--profile-first", action="store_true",
                   help="with --profile: profile the first call itself (new shapes; its row is marked profiled)")  # fmt: skip
    p.set_defaults(func=_run_rollout)


def _run_rollout(args: argparse.Namespace) -> int:
    from slipstream.bench.rollout import run_rollout_command  # torch is imported by the command only

    return run_rollout_command(args)


def run_train_step(args: argparse.Namespace) -> int:
    """Entry point of `slipstream bench train-step`."""
    import torch

    from slipstream.bench.train_step import bench_train_step, memory_curve
    from slipstream.engine.distributed import rank

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if args.repeats < 1 or args.warmup < 0:
        print("--repeats must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    try:
        results["slipstream"] = bench_train_step(
            args.workload, backend=args.backend, max_tokens_per_mb=args.max_tokens_per_mb, dtype=dtype,
            activation_checkpointing=args.ac, compile=args.compile, repeats=args.repeats, warmup=args.warmup,
            device=args.device, preset=args.preset, peak_flops=args.peak_flops, master_dtype=args.master_dtype,
            scale=args.scale,
        )  # fmt: skip
        if args.naive:
            from slipstream.bench.naive import bench_naive

            results["naive"] = bench_naive(
                args.workload, preset=args.preset, micro_batch_size=args.naive_mbs, dtype=dtype,
                repeats=args.repeats, warmup=args.warmup, device=args.device, peak_flops=args.peak_flops,
            )  # fmt: skip
        if args.memory_curve:
            preset = args.preset or results["slipstream"]["workload"]["preset"]
            results["memory_curve"] = memory_curve(
                preset, args.memory_curve, backend=args.backend, dtype=dtype,
                activation_checkpointing=args.ac, compile=args.compile, device=args.device,
                master_dtype=args.master_dtype,
            )  # fmt: skip
    except ValueError as err:
        print(f"bench error: {err}", file=sys.stderr)
        return 2
    if rank() != 0:  # under torchrun only rank 0 reports
        return 0
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    print_results(results)
    return 0


def run_matrix_command(args: argparse.Namespace) -> int:
    """Entry point of `slipstream bench matrix`."""
    from slipstream.bench.matrix import run_matrix
    from slipstream.bench.spec import load_spec
    from slipstream.bench.report import write_matrix_report

    results = args.out / "results.jsonl"
    try:
        if args.benchmarks:
            from slipstream.bench import checkout

            checkout.use(args.benchmarks)
        if not args.report_only:
            spec = load_spec(args.spec)
            run_matrix(spec, results, log=print, resume=args.resume)
        paths = write_matrix_report(results, args.out)
    except ValueError as err:
        print(f"bench error: {err}", file=sys.stderr)
        return 2
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def result_row(name: str, r: dict) -> dict[str, str]:
    """Key figures of one train-step result (slipstream or naive) as table cells."""
    cfg, train = r["config"], r["phases"]["actor_train"]
    fwd = r["phases"].get("log_probs")
    setting = (
        f"{cfg['backend']} cap={cfg['max_tokens_per_mb']} ac={cfg['activation_checkpointing']}"
        + (" compile" if cfg.get("compile") else "")
        + (" bf16-master" if cfg.get("master_dtype") == "bfloat16" else "")
        if cfg["impl"] == "slipstream"
        else f"hf padded mbs={cfg['micro_batch_size']} gc={cfg['gradient_checkpointing']}"
    )
    return {
        "variant": name,
        "preset": r["workload"]["preset"],
        "setting": setting,
        "#mb": str(r["micro_batches"]["count"]),
        "train s": f"{train['time_s']:.3f}",
        "min-max": f"{train['time_min_s']:.2f}-{train['time_max_s']:.2f}",
        "train tok/s": f"{train['tok_per_s']:,.0f}",
        "train TFLOP/s": _fmt(train["tflops"], ".1f"),
        "MFU": _fmt(train["mfu"], ".1%"),
        "train GiB": _fmt(train["peak_memory_gib"], ".1f"),
        "logp s": _fmt(fwd["time_s"] if fwd else None, ".3f"),
        "logp TFLOP/s": _fmt(fwd["tflops"] if fwd else None, ".1f"),
        "logp GiB": _fmt(fwd["peak_memory_gib"] if fwd else None, ".1f"),
    }


def print_results(results: dict[str, dict], title: str = "train step") -> None:
    """A rich table of the train-step results, then the memory-curve / log-prob checks if present."""
    from rich.console import Console
    from rich.table import Table

    # Piped output (the GPU runner, logs) has no terminal width: do not squeeze the columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    rows = [result_row(name, r) for name, r in results.items() if r.get("kind") in ("train_step", "naive_train_step")]
    if rows:
        table = Table(title=title)
        for col in rows[0]:
            table.add_column(col, justify="left" if col in ("variant", "preset", "setting") else "right")
        for row in rows:
            table.add_row(*row.values())
        console.print(table)
    for name, r in results.items():
        if r.get("kind") == "memory_curve":
            points = ", ".join(
                f"{p['tokens']}:{p['peak_memory_gib']:.1f}GiB" if p["peak_memory_gib"] is not None else f"{p['tokens']}:{p['status']}"
                for p in r["points"]
            )  # fmt: skip
            console.print(f"{name} ({r['preset']}, ac={r['activation_checkpointing']}): {points}; "
                          f"largest fitting micro-batch {r['largest_fitting_tokens']} tokens")  # fmt: skip
        elif r.get("kind") == "logprob_memory":
            console.print(
                f"{name}: fused log-probs {r['num_tokens']} x {r['vocab_size']}: extra peak "
                f"{_fmt(r['extra_peak_gib'], '.2f')} GiB vs {r['naive_logits_fp32_gib']:.1f} GiB for fp32 logits, "
                f"{r['time_s']:.3f} s fwd+bwd, max |err| vs fp64 {r['max_abs_err_vs_fp64']:.2e}"
            )
