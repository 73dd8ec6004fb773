"""Where does one training micro-batch spend its time? (GPU diagnostic, prints as it goes)

    python bench/diag_step.py --preset qwen3-1.7b --tokens 16384 --seq 4096

Prints: which attention backend runs, the time of model build, forward, fused log-probs and
backward of one packed micro-batch (CUDA events, after a warm-up), then the top CUDA kernels
from torch.profiler. Used to explain the numbers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from slipstream.bench.workloads import batch_from_lengths
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer
from slipstream.ops.attention import select_backend
from slipstream.ops.logprobs import linear_logprobs


def cuda_time(fn, reps: int = 3) -> float:
    fn()  # warm-up (compiles, autotunes)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    device = torch.device("cuda")
    cfg = get_preset(args.preset)
    t0 = time.perf_counter()
    with torch.device(device):
        model = Transformer(cfg)
    model.init_weights(0)
    torch.cuda.synchronize()
    print(f"build+init on GPU: {time.perf_counter() - t0:.2f} s", flush=True)
    q = torch.zeros(8, cfg.num_heads, cfg.head_dim, device=device, dtype=torch.bfloat16)
    print(f"attention backend for bf16: {select_backend(q)}", flush=True)

    n = args.tokens // args.seq
    batch = batch_from_lengths([(args.seq // 8, args.seq - args.seq // 8)] * n, cfg.vocab_size).to(device)
    weight_of = lambda: model.lm_head_weight.to(torch.bfloat16)  # noqa: E731

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen).to(torch.bfloat16)

    with torch.no_grad():
        t_fwd = cuda_time(forward)
        hidden = forward()
        t_lp = cuda_time(lambda: linear_logprobs(hidden, weight_of(), batch.targets, with_entropy=True))
    print(f"forward (no grad) {t_fwd * 1e3:.1f} ms | fused log-prob+entropy fwd {t_lp * 1e3:.1f} ms", flush=True)

    def fwd_bwd():
        hidden = forward()
        lp, ent = linear_logprobs(hidden, weight_of(), batch.targets, with_entropy=True)
        (lp.sum() + ent.sum()).backward()

    t_fb = cuda_time(fwd_bwd)
    flops = 6 * cfg.num_matmul_params * args.tokens + 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * args.seq**2
    print(f"fwd+bwd {t_fb * 1e3:.1f} ms -> {flops / t_fb / 1e12:.1f} TFLOP/s ({args.tokens / t_fb:,.0f} tok/s)", flush=True)
    print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fwd_bwd()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
