"""varlen (FlashAttention via torch varlen_attn) vs flex_attention (document mask) on W1 lengths (GPU).

    python benchmarks/tools/bench_attention.py [--tokens 32768] [--out result.json]

Packs W1's sequence lengths (shuffled, seed of the workload) into one micro-batch of up to
`--tokens` tokens, with qwen3-1.7b's attention shape (16 query heads, 8 kv heads, head dim 128,
bf16), and times forward + backward of each backend (CUDA events, 2 warm-ups, median of 5).
Prints one line per backend with ms and causal-counted TFLOP/s; `select_backend` uses varlen
when it exists, and this is the measurement behind that choice.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from slipstream.bench.workloads import get_workload, seq_lens
from slipstream.ops.attention import probe_native_gqa, varlen_causal_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda")
    lens, total = [], 0
    for n in seq_lens(get_workload("W1")):
        if total + n > args.tokens:
            break
        lens.append(n)
        total += n
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(total, 16, 128, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(total, 8, 128, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(total, 8, 128, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(total, 16, 128, device=device, dtype=torch.bfloat16, generator=gen)
    probe_native_gqa(device)
    # causal fwd = 2 matmuls of S^2/2 * D per head (x2 FLOPs per MAC); fwd + bwd = 3x that
    flops = 3 * 2 * 2 * 16 * 128 * sum(n * n for n in lens) / 2
    print(f"{len(lens)} sequences, {total} tokens, max {max(lens)}; fwd+bwd {flops / 1e12:.2f} TFLOP (causal)")
    record = {"sequences": len(lens), "tokens": total, "max_len": max(lens), "flops": flops, "backends": {}}
    for backend in ("varlen", "flex"):
        def run() -> None:
            out = varlen_causal_attention(q, k, v, cu, max(lens), backend=backend)
            out.backward(grad)

        try:
            for _ in range(2):
                run()
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        except (RuntimeError, ValueError) as err:
            print(f"{backend:7s} failed: {str(err).splitlines()[0][:120]}")
            record["backends"][backend] = {"status": "error", "reason": str(err).splitlines()[0]}
            continue
        t = statistics.median(times)
        print(f"{backend:7s} fwd+bwd {t * 1e3:7.2f} ms (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f})"
              f" -> {flops / t / 1e12:6.1f} TFLOP/s")
        record["backends"][backend] = {"status": "ok", "time_s": t, "times_s": times, "tflops": flops / t / 1e12}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
