"""The decode-attention kernel's launch settings and their text form (`rollout.decode_launch`).

Torch-free, so that the config schema can check a launch without importing the kernels."""

from __future__ import annotations

from collections.abc import Mapping

LAUNCH = {"block_n": 64, "num_warps": 4, "num_stages": 4, "heads_first": 1, "longest_first": 1}
"""Default launch configuration of the split kernel: cache rows per inner iteration, warps, pipeline stages, the
grid order (heads_first=1: the programs of one sequence's kv heads are neighbours in the launch
order, so the GPU runs them together and they read the cache rows, which interleave the heads, as
one stream; 0: neighbours are sequences of the same head; heads first read ~4% faster on a 256-sequence
batch), and the sequence order (longest_first=1: the programs of the longest sequences start first, so
the short ones fill the end of the launch instead of a long one running alone there; the order is one
argsort of the lengths per decode step, `launch_order`; with several splits a sequence's later splits
still come after every sequence's first one). Chosen by `bench_decode_attention.py` and nano-vllm's
workload on the H200 (4 stages: +1.0 point of the bound on a first call, longest first +1.1, one run side
by side; see docs/benchmarks.md). An engine's own launch comes from `rollout.decode_launch`
(`parse_launch`), passed to `decode_attention` / `launch_order` as `launch`."""

LAUNCH_FORMAT = "block_n,num_warps,num_stages[,heads_first[,longest_first]]"
"""The text form of a launch (`rollout.decode_launch`, `slipstream bench rollout --decode-launch`)."""


def parse_launch(text: str) -> dict[str, int]:
    """A launch from its text form (LAUNCH_FORMAT): the leading keys given, the others at LAUNCH's values.

    block_n is a power of two (the kernel's tile), warps and stages >= 1, the two orders 0 or 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    launch = {**LAUNCH, **dict(zip(LAUNCH, values))}
    n = launch["block_n"]
    if (
        not 3 <= len(values) <= len(LAUNCH)
        or n < 1 or n & (n - 1)
        or min(launch["num_warps"], launch["num_stages"]) < 1
        or not {launch["heads_first"], launch["longest_first"]} <= {0, 1}
    ):  # fmt: skip
        raise ValueError(
            f"a decode launch is {LAUNCH_FORMAT}: a power-of-two block_n, warps and stages >= 1, the orders 0 or 1; "
            f"got {text!r}"
        )
    return launch


def launch_text(launch: Mapping[str, int]) -> str:
    """The text form of a launch, every key written: `parse_launch(launch_text(x)) == x`."""
    return ",".join(str(launch[key]) for key in LAUNCH)
