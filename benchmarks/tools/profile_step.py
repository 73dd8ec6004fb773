"""Where does the actor update's time go? GPU-kernel time per category for one full W1 update.

    python benchmarks/tools/profile_step.py --workload W1 --backend fsdp --max-tokens-per-mb 32768 --compile

Builds exactly what `slipstream bench train-step` times (same engine, workload, planner), runs
two warm-up updates, times one with CUDA events, then records one under torch.profiler and
sums CUDA kernel time per category (matmuls, attention forward / backward, the fused log-prob
kernels, compiled elementwise, optimizer, FSDP copies, ...). "GPU busy" is the union of kernel
intervals on all streams; wall minus busy is time the GPU waited on the host. Prints a table
and writes JSON with --out. Used for the "what limits MFU" record in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from slipstream.algo.losses import SpecLoss
from slipstream.bench.train_step import (
    _build_model,
    build_engine_for_bench,
    plan_and_select,
    resolve_device,
    time_once,
)
from slipstream.bench.workloads import get_workload, synthetic_batch
from slipstream.models.presets import get_preset
from slipstream.perf.flops import train_flops

# First matching pattern wins (kernel names lower-cased).
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention bwd (flash)", r"flash.*bwd|bwd.*flash|flash_backward"),
    ("attention fwd (flash)", r"flash"),
    ("log-prob kernels (triton)", r"_fwd_stats_kernel|_grad_logits_kernel"),
    ("compiled elementwise (inductor)", r"^triton_"),
    ("optimizer (adamw)", r"adam|multi_tensor"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_"),
    ("fsdp copies / collectives", r"nccl|chunk_cat|split_with_sizes|all_gather|reduce_scatter|foreach_copy"),
    ("copy / cast", r"copy|cast|convert"),
    ("other elementwise / reductions", r"elementwise|vectorized|reduce|index|scatter|gather|embedding"),
)


def categorise(name: str) -> str:
    lower = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lower):
            return label
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def kernel_events(prof) -> list:
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--backend", default="fsdp")
    parser.add_argument("--max-tokens-per-mb", type=int, default=32768)
    parser.add_argument("--activation-checkpointing", default="none")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--master-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = resolve_device(None, args.backend)
    w = get_workload(args.workload, args.preset)
    cfg = get_preset(w.preset)
    engine = build_engine_for_bench(
        _build_model(cfg, device, 0), args.backend, device, torch.bfloat16, args.max_tokens_per_mb,
        args.activation_checkpointing, args.compile, args.master_dtype,
    )  # fmt: skip
    device = engine.device
    batch = synthetic_batch(w, cfg.vocab_size)
    mbs = plan_and_select(batch, cfg, args.max_tokens_per_mb)
    loss_fn = SpecLoss(needs_entropy=False)

    def update() -> None:
        engine.forward_backward(mbs, loss_fn, max_response_len=w.response_len[1])
        engine.optim_step()

    for _ in range(2):
        update()
    wall_s, peak = time_once(update, device)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        update()
        torch.cuda.synchronize()
    kernels = kernel_events(prof)
    per_cat: dict[str, float] = {}
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        dur = e.time_range.end - e.time_range.start
        per_cat[categorise(e.name)] = per_cat.get(categorise(e.name), 0.0) + dur
        per_name.setdefault(e.name, [0.0, 0])
        per_name[e.name][0] += dur
        per_name[e.name][1] += 1
    busy_us = union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    span_us = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    flops = train_flops(cfg, batch.seq_lens())
    kernel_sum = sum(per_cat.values())

    print(f"\n{w.name} on {w.preset}: backend {args.backend}, {len(mbs)} micro-batches of <= {args.max_tokens_per_mb} "
          f"tokens, AC {args.activation_checkpointing}, compile {args.compile}, master {args.master_dtype}")
    print(f"update wall (CUDA events, unprofiled) {wall_s * 1e3:.0f} ms -> {flops / wall_s / 1e12:.1f} TFLOP/s; "
          f"peak {peak / 2**30 if peak else float('nan'):.1f} GiB")
    print(f"profiled: kernel span {span_us / 1e3:.0f} ms, GPU busy (union) {busy_us / 1e3:.0f} ms "
          f"({100 * busy_us / span_us:.1f}% of span), {len(kernels)} kernel launches")
    print(f"{'category':34s} {'ms':>8s} {'% kernel time':>14s}")
    for label, us in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        print(f"{label:34s} {us / 1e3:8.1f} {100 * us / kernel_sum:13.1f}%")
    print(f"\ntop {args.top} kernels by total time:")
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[: args.top]
    for name, (us, count) in top:
        print(f"{us / 1e3:8.1f} ms {count:6d}x  {categorise(name)[:18]:18s} {name[:90]}")
    print("\ntop 3 kernels of each other category:")
    for label in sorted(per_cat, key=lambda c: -per_cat[c]):
        if label == "matmul":
            continue
        names = sorted((kv for kv in per_name.items() if categorise(kv[0]) == label), key=lambda kv: -kv[1][0])[:3]
        for name, (us, count) in names:
            print(f"  {label[:24]:24s} {us / 1e3:7.1f} ms {count:6d}x  {name[:100]}")
    if args.out:
        record = {
            "workload": w.name, "preset": w.preset, "backend": args.backend,
            "max_tokens_per_mb": args.max_tokens_per_mb, "activation_checkpointing": args.activation_checkpointing,
            "compile": args.compile, "micro_batches": len(mbs), "update_wall_s": wall_s, "peak_bytes": peak,
            "train_flops": flops, "kernel_span_us": span_us, "gpu_busy_us": busy_us, "kernel_launches": len(kernels),
            "per_category_us": per_cat,
            "top_kernels": [{"name": n, "us": us, "count": c} for n, (us, c) in top],
        }  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
