"""Balance of the DP plan for weak scaling (issue 6), on the CPU: W1's per-GPU work (`--scale K`) on K ranks.

    python bench/plan_balance.py [--workload W1] [--max-tokens-per-mb 32768] [--ranks 1,2,4,8]

For each K, plans W1 x K over K ranks with the trainer's planner and prints the micro-batches per
rank, real tokens per rank (min-max) and the estimated work (linear + causal-attention term of the
workload's model, `batching/planner.py:token_work`) of the busiest rank against the mean: the
step waits for the busiest rank, so max/mean - 1 is the time the plan itself loses to imbalance.
"""

from __future__ import annotations

import argparse

from slipstream.batching.planner import plan_micro_batches, quadratic_scale_for, token_work
from slipstream.bench.workloads import get_workload, scaled, seq_lens
from slipstream.models.presets import get_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--max-tokens-per-mb", type=int, default=32768)
    parser.add_argument("--ranks", default="1,2,4,8")
    args = parser.parse_args()
    base = get_workload(args.workload)
    scale = quadratic_scale_for(get_preset(base.preset))
    print(f"{'ranks':>5} {'seqs':>5} {'mb/rank':>7} {'tokens/rank min-max':>21} {'work max/mean':>13}")
    for k in (int(x) for x in args.ranks.split(",")):
        lens = seq_lens(scaled(base, k))
        plan = plan_micro_batches(lens, args.max_tokens_per_mb, num_ranks=k, quadratic_scale=scale)
        tokens = [sum(lens[i] for mb in rank for i in mb) for rank in plan.assignments]
        work = [sum(token_work(lens[i], scale) for mb in rank for i in mb) for rank in plan.assignments]
        print(f"{k:>5} {len(lens):>5} {plan.num_micro_batches:>7} {min(tokens):>10,}-{max(tokens):<10,}"
              f" {max(work) / (sum(work) / k):>13.6f}")


if __name__ == "__main__":
    main()
