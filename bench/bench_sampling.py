"""Sampling one token per row from fp32 logits: `sample_tokens` compiled with torch vs the one-pass Triton kernel (GPU).

    python bench/bench_sampling.py [--out results.json]

qwen3's vocabulary (151,936), temperature 0.6 without top-k / top-p (the rollout's default mode),
rows 256 / 128 / 32 / 8 (a decode step's batch as an RL step's rows finish). Each variant reads the
same logits; the logits' bytes over the time give the achieved bandwidth of one read (the torch
path reads them three times). Each variant is captured as 10 calls in one CUDA graph, as the decode
step runs it (launched one by one from the host, the small cases time the launches instead:
~240 us for either variant at 8 rows); CUDA events, median of 20 replays after 3 warm-ups, divided
by 10. Also the share of rows where the two variants draw the same token (the noise bits are equal;
only the last ulp of the logs may differ).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from slipstream.ops.sampling import sample_rows
from slipstream.perf.timers import repeat_timed
from slipstream.rollout.sampler import sample_tokens, vocab_hashes

VOCAB = 151_936
ROWS = (256, 128, 32, 8)


CALLS_PER_GRAPH = 10


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
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hashes = vocab_hashes(VOCAB, dev)
    temperature = torch.tensor(0.6, device=dev)
    compiled = torch.compile(sample_tokens, dynamic=True)
    variants = {
        "torch-compiled": lambda lg, s, i: compiled(lg, temperature, s, i, hashes, False),
        "triton-one-pass": lambda lg, s, i: sample_rows(lg, temperature, s, i, hashes, False),
    }
    rows_out = []
    for rows in ROWS:
        logits = torch.randn(rows, VOCAB, device=dev, generator=gen) * 4
        seeds = torch.randint(0, 1 << 32, (rows,), device=dev, generator=gen)
        index = torch.randint(0, 1024, (rows,), device=dev, generator=gen)
        tokens = {}
        for name, fn in variants.items():
            t = _graph_seconds(lambda: fn(logits, seeds, index), dev)
            tokens[name] = fn(logits, seeds, index)[0]
            rows_out.append({"rows": rows, "variant": name, "us": t * 1e6, "tb_per_s": logits.numel() * 4 / t / 1e12})
        same = float((tokens["torch-compiled"] == tokens["triton-one-pass"]).float().mean())
        rows_out.append({"rows": rows, "variant": "same-token-share", "value": same})
    for r in rows_out:
        print(json.dumps(r))
    print("rows | torch compiled us | triton one-pass us | same token")
    for rows in ROWS:
        got = {r["variant"]: r for r in rows_out if r["rows"] == rows}
        print(f"{rows} | {got['torch-compiled']['us']:.1f} | {got['triton-one-pass']['us']:.1f} | "
              f"{got['same-token-share']['value']:.4f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
