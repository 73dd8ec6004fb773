"""Decode attention over the slot cache: Triton split-K launch configurations vs FlashAttention (GPU).

    python benchmarks/tools/bench_decode_attention.py [--out results.json]

qwen3's attention shape (16 query heads on 8 kv heads, head dim 128, bf16), one query per
sequence, contexts drawn around a mean per case, each sequence in its own cache slot. Every
kernel reads each sequence's keys and values once, so the achieved bandwidth is
(keys + values bytes) / time. Cases: a big batch (256 x ~1100, the nanovllm workload's middle), a
medium one (64 x ~768, W1-sized) and the long tail of an RL step (8 x ~3000, 1 x ~4000).
CUDA events, median of 20 after 5 warm-ups. Prints one line per (case, kernel) and the best
launch configuration per case (block rows, warps, stages, grid order);
`ops/decode_attention.py:LAUNCH` holds the chosen one. Then, at the chosen launch, 2x / 4x / 8x
the split count `choose_splits` gives (its programs-per-SM target is
`ops/decode_attention.py:PROGRAMS_PER_SM`), and the launch order of the sequences (as given, and
longest first).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from slipstream.ops import decode_attention
from slipstream.ops.attention import cache_attention
from slipstream.perf.timers import repeat_timed

CASES = {"b256-ctx1100": (256, 1100), "b64-ctx768": (64, 768), "b8-ctx3000": (8, 3000), "b1-ctx4000": (1, 4000)}
CONFIGS = [
    dict(block_n=n, num_warps=w, num_stages=s, heads_first=h, longest_first=0)
    for n, w, s, h in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (0, 1))
]


def _time(fn, device: torch.device) -> float:
    """Median seconds of 20 calls after 5 warm-ups (CUDA events)."""
    return statistics.median(repeat_timed(fn, device, repeats=20, warmup=5)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--best-to", default=None,
                        help="write the launch configuration with the highest mean bandwidth over the cases here, "
                        "as rollout.decode_launch and `bench rollout --decode-launch` take it")  # fmt: skip
    args = parser.parse_args()
    dev = torch.device("cuda")
    chosen = dict(decode_attention.LAUNCH)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (batch, mean_ctx) in CASES.items():
        slot_len = 2 * mean_ctx
        lengths = torch.randint(mean_ctx // 2, 3 * mean_ctx // 2, (batch,), device=dev, generator=gen, dtype=torch.int32)
        k = torch.randn(batch * slot_len, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        q = torch.randn(batch, 16, 128, device=dev, dtype=torch.bfloat16, generator=gen)
        starts = torch.arange(batch, device=dev, dtype=torch.int32) * slot_len
        cu_k = torch.cat([starts, torch.tensor([batch * slot_len], device=dev, dtype=torch.int32)])
        cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        kv_bytes = int(lengths.sum()) * 8 * 128 * 2 * 2
        splits = decode_attention.choose_splits(batch, 8, dev)
        flash = _time(lambda: cache_attention(q, k, v, cu_q, cu_k, lengths, 1, slot_len, False, decode_kernel="flash"),
                      dev)  # fmt: skip
        rows.append({"case": name, "kernel": "flash", "s": flash, "tb_per_s": kv_bytes / flash / 1e12})
        for cfg in CONFIGS:
            decode_attention.LAUNCH.update(cfg)
            try:
                t = _time(lambda: decode_attention.decode_attention(q, k, v, starts, lengths, splits), dev)
            except Exception as err:  # a configuration the compiler refuses (shared memory): skip it
                print(f"{name} {cfg}: {type(err).__name__}")
                continue
            rows.append({"case": name, "kernel": "triton", **cfg, "splits": splits, "s": t, "tb_per_s": kv_bytes / t / 1e12})
        # the split count at the chosen launch: choose_splits gives one split to big batches; more programs may
        # hide more memory latency there
        decode_attention.LAUNCH.update(chosen)
        for more in (2 * splits, 4 * splits, 8 * splits):
            t = _time(lambda: decode_attention.decode_attention(q, k, v, starts, lengths, more), dev)
            rows.append({"case": name, "kernel": "triton-splits", **chosen, "splits": more, "s": t,
                         "tb_per_s": kv_bytes / t / 1e12})  # fmt: skip
        # the launch order: longest sequence first (its argsort made once per decode step, outside the timing)
        for longest_first in (0, 1):
            launch = dict(chosen, longest_first=longest_first)
            decode_attention.LAUNCH.update(launch)
            order = decode_attention.launch_order(lengths)
            t = _time(lambda: decode_attention.decode_attention(q, k, v, starts, lengths, splits, order=order), dev)
            rows.append({"case": name, "kernel": "triton-order", **launch, "splits": splits, "s": t,
                         "tb_per_s": kv_bytes / t / 1e12})  # fmt: skip
        decode_attention.LAUNCH.update(chosen)
    for r in rows:
        print(json.dumps(r))
    for name in CASES:
        best = max((r for r in rows if r["case"] == name and r["kernel"] == "triton"), key=lambda r: r["tb_per_s"])
        flash = next(r for r in rows if r["case"] == name and r["kernel"] == "flash")
        split_rows = [r for r in rows if r["case"] == name and r["kernel"] == "triton-splits"]
        at_chosen = next(r for r in rows if r["case"] == name and r["kernel"] == "triton"
                         and all(r[key] == value for key, value in chosen.items() if key != "longest_first"))  # fmt: skip
        by_splits = ", ".join(f"{r['splits']}: {r['tb_per_s']:.2f}" for r in [at_chosen, *split_rows])
        by_order = ", ".join(f"{r['longest_first']}: {r['tb_per_s']:.2f}"
                             for r in rows if r["case"] == name and r["kernel"] == "triton-order")  # fmt: skip
        print(f"{name}: flash {flash['tb_per_s']:.2f} TB/s; best triton {best['tb_per_s']:.2f} TB/s "
              f"(block_n={best['block_n']} warps={best['num_warps']} stages={best['num_stages']} "
              f"heads_first={best['heads_first']} splits={best['splits']}); "
              f"at the chosen launch by splits (TB/s): {by_splits}; by longest_first: {by_order}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.best_to:
        def mean_bw(cfg):
            got = [r["tb_per_s"] for r in rows if r["kernel"] == "triton" and all(r[k] == v for k, v in cfg.items())]
            return sum(got) / len(CASES) if len(got) == len(CASES) else 0.0

        best = max(CONFIGS, key=mean_bw)
        print(f"best over the cases: {best} ({mean_bw(best):.2f} TB/s mean)")
        with open(args.best_to, "w") as f:
            f.write(",".join(str(best[key]) for key in decode_attention.LAUNCH))


if __name__ == "__main__":
    main()
