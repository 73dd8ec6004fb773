"""Sampling one token per row on the GPU: the LM head's fp32 logits then a sampler, against the fused kernel.

    python benchmarks/tools/bench_sampling.py [--hidden 1024] [--out results.json]

qwen3's vocabulary (151,936), bf16 hidden states and LM head (hidden size 1024: qwen3-0.6b; 2048: 1.7b),
temperature 0.6 without top-k / top-p (the rollout's default mode), rows 256 / 128 / 32 / 8 (a decode step's
batch as an RL step's rows finish). Variants, each on the same inputs:

- `head`: the LM-head matmul alone (`mm_fp32`: fp32 logits from an fp32-accumulated bf16 GEMM);
- `head+torch-compiled`: it, then `sample_tokens` compiled with torch (three passes over the logits);
- `head+triton-one-pass`: it, then `ops/sampling.py:sample_rows` (what the model runner runs by default);
- `fused <launch>`: `ops/sampling.py:sample_hidden` (the matmul inside the sampling kernel, no logits in
  memory) at each launch of a small sweep of `HEAD_LAUNCH` (rows / vocabulary / hidden tile, warps, stages,
  programs per SM).

Each variant is captured as 10 calls in one CUDA graph, as the decode step runs it; CUDA events, median of
20 replays after 3 warm-ups, divided by 10. `weight_tb_per_s` is the LM head's bytes over the time (the
matmul must read them once). Also the share of rows where the fused kernel draws the same token as
`head+triton-one-pass` (the same noise; the logits differ by the order of the matmul's additions).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from slipstream.ops import sampling
from slipstream.ops.logprobs import mm_fp32
from slipstream.perf.timers import repeat_timed
from slipstream.rollout.sampler import sample_tokens, vocab_hashes

VOCAB = 151_936
ROWS = (256, 128, 32, 8)
CALLS_PER_GRAPH = 10
FUSED_SWEEP = {"block_m": (16, 64), "block_n": (64, 128), "num_stages": (3, 4), "programs_per_sm": (1, 2, 4)}
"""Launch keys swept for the fused kernel (the others stay at `HEAD_LAUNCH`'s values)."""


def _graph_seconds(fn, device: torch.device) -> float:
    """Seconds per call of fn() replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles and settles before the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    return statistics.median(repeat_timed(graph.replay, device, repeats=20, warmup=3)[0]) / CALLS_PER_GRAPH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (1024: qwen3-0.6b, 2048: qwen3-1.7b)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hashes = vocab_hashes(VOCAB, dev)
    temperature = torch.tensor(0.6, device=dev)
    weight = (torch.randn(VOCAB, args.hidden, device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    compiled = torch.compile(sample_tokens, dynamic=True)
    default = dict(sampling.HEAD_LAUNCH)
    launches = [dict(default, **dict(zip(FUSED_SWEEP, values))) for values in itertools.product(*FUSED_SWEEP.values())]
    results = []
    for rows in ROWS:
        hidden = torch.randn(rows, args.hidden, device=dev, generator=gen).to(torch.bfloat16)
        seeds = torch.randint(0, 1 << 32, (rows,), device=dev, generator=gen)
        index = torch.randint(0, 1024, (rows,), device=dev, generator=gen)
        variants = {
            "head": lambda: mm_fp32(hidden, weight.t()),
            "head+torch-compiled": lambda: compiled(mm_fp32(hidden, weight.t()), temperature, seeds, index, hashes, False),
            "head+triton-one-pass": lambda: sampling.sample_rows(
                mm_fp32(hidden, weight.t()), temperature, seeds, index, hashes, False
            ),
        }
        for name, fn in variants.items():
            t = _graph_seconds(fn, dev)
            results.append({"rows": rows, "variant": name, "us": t * 1e6, "weight_tb_per_s": weight.numel() * 2 / t / 1e12})
        reference = variants["head+triton-one-pass"]()[0]
        for launch in launches:
            sampling.HEAD_LAUNCH.update(launch)
            fn = lambda: sampling.sample_hidden(hidden, weight, temperature, seeds, index, hashes, False)  # noqa: E731
            try:
                t = _graph_seconds(fn, dev)
            except Exception as err:  # a launch that does not fit the SM (shared memory, registers) is skipped
                results.append({"rows": rows, "variant": "fused", "launch": launch, "error": repr(err)[:200]})
                continue
            same = float((fn()[0] == reference).float().mean())
            results.append({"rows": rows, "variant": "fused", "launch": launch, "us": t * 1e6,
                            "weight_tb_per_s": weight.numel() * 2 / t / 1e12, "same_token_share": same})  # fmt: skip
        sampling.HEAD_LAUNCH.update(default)
    for r in results:
        print(json.dumps(r))
    print("rows | head us | +torch compiled | +triton one-pass | fused, default launch | fused, best launch | same token")
    for rows in ROWS:
        got = {r["variant"]: r for r in results if r["rows"] == rows and r["variant"] != "fused"}
        fused = [r for r in results if r["rows"] == rows and r["variant"] == "fused" and "us" in r]
        best = min(fused, key=lambda r: r["us"], default=None)
        at_default = next((r for r in fused if r["launch"] == default), None)
        show = lambda r: "-" if r is None else f"{r['us']:.1f}"  # noqa: E731
        launch = "" if best is None else " (" + ",".join(f"{k}={best['launch'][k]}" for k in FUSED_SWEEP) + ")"
        print(f"{rows} | {got['head']['us']:.1f} | {got['head+torch-compiled']['us']:.1f} | "
              f"{got['head+triton-one-pass']['us']:.1f} | {show(at_default)} | {show(best)}{launch} | "
              f"{'-' if best is None else format(best['same_token_share'], '.4f')}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"hidden": args.hidden, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
