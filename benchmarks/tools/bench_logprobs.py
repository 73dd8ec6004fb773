"""Time fwd+bwd of linear -> logprob (+ entropy): naive full logits vs slipstream's chunked impls.

Usage (CUDA): python benchmarks/tools/bench_logprobs.py [--sizes 8192x151936x2048 ...] [--out bench_logprobs.json]

Each row: one (T tokens, V vocab, H hidden) size and one implementation, bf16 inputs.
"naive" builds full logits, .float(), log_softmax and gather (what most RL trainers do).
Reported: median ms per fwd+bwd, model TFLOP/s (6*T*V*H, the LM-head matmuls; the chunked
impls also recompute the forward matmul in backward, which is not counted), peak memory
beyond inputs + weight, and max |logprob - naive| as a sanity check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from slipstream.ops.logprobs import linear_logprobs

DEFAULT_SIZES = ["4096x151936x2048", "16384x151936x2048", "65536x151936x2048", "16384x32000x4096"]


def naive_logprobs(hidden, weight, targets, temperature, with_entropy):
    """Full (T, V) logits in fp32: the baseline that the fused op avoids."""
    logp = ((hidden @ weight.T).float() / temperature).log_softmax(dim=-1)
    lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    entropy = -(logp.exp() * logp).sum(dim=-1) if with_entropy else None
    return lp, entropy


def run_once(impl, hidden, weight, targets, g_lp, g_ent, with_entropy):
    if impl == "naive":
        lp, ent = naive_logprobs(hidden, weight, targets, 1.0, with_entropy)
    else:
        lp, ent = linear_logprobs(hidden, weight, targets, with_entropy=with_entropy, impl=impl)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    torch.autograd.grad(loss, (hidden, weight))
    return lp.detach()


def bench_one(impl, num_tokens, vocab, hidden_size, with_entropy, iters, reference_lp):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    hidden.requires_grad_()
    weight.requires_grad_()
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen, device="cuda")
    g_lp, g_ent = torch.randn(2, num_tokens, generator=gen, device="cuda")
    row = {"impl": impl, "tokens": num_tokens, "vocab": vocab, "hidden": hidden_size, "entropy": with_entropy}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        lp = run_once(impl, hidden, weight, targets, g_lp, g_ent, with_entropy)  # warm-up, compiles kernels
        torch.cuda.synchronize()
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_once(impl, hidden, weight, targets, g_lp, g_ent, with_entropy)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    except torch.OutOfMemoryError:
        row["status"] = "oom"
        return row, None
    ms = statistics.median(times)
    row.update(status="ok", ms=ms, tflops=6 * num_tokens * vocab * hidden_size / (ms * 1e-3) / 1e12)
    if reference_lp is not None:
        row["max_abs_diff_vs_naive"] = (lp - reference_lp).abs().max().item()
    return row, lp


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark matrix, print a table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="TxVxH triples")
    parser.add_argument("--impls", nargs="+", default=["naive", "torch", "triton"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--no-entropy", action="store_true", help="logprobs only")
    parser.add_argument("--out", default="bench_logprobs.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_logprobs needs CUDA", file=sys.stderr)
        return 1
    sizes = []
    for text in args.sizes:
        parts = text.lower().split("x")
        if len(parts) != 3:
            raise ValueError(f"size {text!r} must look like TxVxH, e.g. 8192x151936x2048")
        sizes.append(tuple(int(p) for p in parts))

    rows = []
    header = f"{'T':>7} {'V':>7} {'H':>5} {'impl':>7} {'ms':>9} {'TFLOP/s':>8} {'peak GiB':>9} {'|dlp|':>9}"
    print(header)
    print("-" * len(header))
    for num_tokens, vocab, hidden_size in sizes:
        reference_lp = None
        for impl in args.impls:
            row, lp = bench_one(
                impl, num_tokens, vocab, hidden_size, not args.no_entropy, args.iters,
                reference_lp if impl != "naive" else None,
            )
            if impl == "naive":
                reference_lp = lp
            rows.append(row)
            torch.cuda.empty_cache()
            if row["status"] == "oom":
                print(f"{num_tokens:>7} {vocab:>7} {hidden_size:>5} {impl:>7} {'OOM':>9}")
                continue
            diff = row.get("max_abs_diff_vs_naive")
            print(
                f"{num_tokens:>7} {vocab:>7} {hidden_size:>5} {impl:>7} {row['ms']:>9.2f} {row['tflops']:>8.1f}"
                f" {row['peak_extra_gib']:>9.2f} {'-' if diff is None else f'{diff:.2e}':>9}"
            )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "entropy": not args.no_entropy,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
