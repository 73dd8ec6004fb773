"""Named, deterministic training-step workloads: sequence lengths plus a synthetic `PackedBatch`.

A workload fixes *what* is trained on (how many sequences, how long, which model shape), never
*how*: backends, micro-batch budgets and baselines are all measured on the same lengths, so
their tokens/s and MFU compare like for like.

W1 (issue 3) mirrors a GRPO step of AReaL #193 on one GPU's share: Qwen3-1.7B, 8 prompts x
group 8 = 64 sequences of 512 prompt tokens and responses spread evenly from 256 to 3584
tokens (shuffled), 155,648 real tokens in all.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slipstream.batching.packing import pack_samples
from slipstream.batching.records import PackedBatch, Sample

W1_TOTAL_TOKENS = 155_648
"""64 * 512 prompt tokens + sum(linspace(256, 3584, 64)) response tokens."""


@dataclass(frozen=True)
class Workload:
    """Shape of one RL minibatch: model preset, groups of completions and their lengths."""

    name: str
    """Name used in results and on the command line (e.g. "W1")."""
    preset: str
    """Model preset (slipstream.models.presets) the workload is run on."""
    num_prompts: int
    """Prompts in the minibatch; each has `group_size` completions sharing its prompt length."""
    group_size: int
    """Completions per prompt (GRPO group)."""
    prompt_len: tuple[int, int]
    """(min, max) prompt length in tokens, drawn uniformly per prompt; (512, 512) is a fixed length."""
    response_len: tuple[int, int]
    """(min, max) response length in tokens."""
    response_dist: str = "linspace"
    """"linspace": evenly spaced from min to max then shuffled; "uniform": drawn uniformly per sequence."""
    seed: int = 0
    """Seed of the shuffle / draws of the lengths (and the default seed of the synthetic batch)."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.group_size < 1:
            raise ValueError(f"num_prompts and group_size must be >= 1; got {self.num_prompts}, {self.group_size}")
        for what, (lo, hi) in (("prompt_len", self.prompt_len), ("response_len", self.response_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{what} must be (min, max) with 1 <= min <= max; got {(lo, hi)}")
        if self.response_dist not in ("linspace", "uniform"):
            raise ValueError(f"response_dist must be 'linspace' or 'uniform'; got {self.response_dist!r}")

    @property
    def num_seqs(self) -> int:
        return self.num_prompts * self.group_size

    def with_preset(self, preset: str, name: str | None = None) -> "Workload":
        """The same lengths on another model preset."""
        return Workload(
            name=name or f"{self.name}@{preset}", preset=preset, num_prompts=self.num_prompts,
            group_size=self.group_size, prompt_len=self.prompt_len, response_len=self.response_len,
            response_dist=self.response_dist, seed=self.seed,
        )  # fmt: skip


def scaled(w: Workload, k: int) -> Workload:
    """`w` with k times its prompts (the same length distribution): W1's per-GPU work on k GPUs."""
    if k < 1:
        raise ValueError(f"scale must be >= 1, got {k}")
    return w if k == 1 else dataclasses.replace(w, name=f"{w.name}x{k}", num_prompts=w.num_prompts * k)


def make_lengths(w: Workload) -> list[tuple[int, int]]:
    """(prompt_len, response_len) per sequence, group by group; deterministic in `w.seed`."""
    rng = random.Random(w.seed)
    prompt_lens = [rng.randint(*w.prompt_len) for _ in range(w.num_prompts)]
    n = w.num_seqs
    lo, hi = w.response_len
    if w.response_dist == "linspace":
        # Evenly spaced lengths (rounded), then shuffled so no group gets only short or long ones.
        step = (hi - lo) / (n - 1) if n > 1 else 0.0
        responses = [round(lo + i * step) for i in range(n)]
        rng.shuffle(responses)
    else:
        responses = [rng.randint(lo, hi) for _ in range(n)]
    return [(prompt_lens[i // w.group_size], responses[i]) for i in range(n)]


def seq_lens(w: Workload) -> list[int]:
    """Total (prompt + response) length of every sequence of the workload."""
    return [p + r for p, r in make_lengths(w)]


_W1 = Workload(
    name="W1", preset="qwen3-1.7b", num_prompts=8, group_size=8,
    prompt_len=(512, 512), response_len=(256, 3584), seed=1234,
)  # fmt: skip

WORKLOADS: dict[str, Workload] = {
    "W1": _W1,
    "W1-0.6b": _W1.with_preset("qwen3-0.6b", "W1-0.6b"),
    "W1-4b": _W1.with_preset("qwen3-4b", "W1-4b"),
    "W1-8b": _W1.with_preset("qwen3-8b", "W1-8b"),
    # CPU tests: a few short sequences of uneven length on the tiny preset.
    "tiny": Workload(
        name="tiny", preset="tiny", num_prompts=2, group_size=4,
        prompt_len=(4, 12), response_len=(6, 40), seed=0,
    ),  # fmt: skip
}
assert sum(seq_lens(WORKLOADS["W1"])) == W1_TOTAL_TOKENS


def get_workload(name: str, preset: str | None = None) -> Workload:
    """Named workload, optionally moved to another model preset."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; available: {', '.join(WORKLOADS)}")
    w = WORKLOADS[name]
    return w if preset is None or preset == w.preset else w.with_preset(preset)


def synthetic_batch(w: Workload, vocab_size: int, seed: int | None = None) -> PackedBatch:
    """Random-token `PackedBatch` of the workload with advantages, behaviour and old log-probs."""
    return batch_from_lengths(make_lengths(w), vocab_size, w.group_size, w.seed if seed is None else seed)


def batch_from_lengths(
    lengths: Sequence[tuple[int, int]], vocab_size: int, group_size: int = 1, seed: int = 0
) -> PackedBatch:
    """Random-token `PackedBatch` for (prompt_len, response_len) pairs, ready for the PPO loss.

    Token ids are uniform in [0, vocab_size). Advantages are group-normalised normal draws
    (what GRPO produces; plain normal draws when group_size is 1). Behaviour and old
    log-probs are scattered around -log(V), the log-prob of a randomly initialised model, so
    the PPO ratio exp(logp - old) is near 1 but not equal to it and the clipped path runs.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if len(lengths) % group_size:
        raise ValueError(f"{len(lengths)} sequences do not split into groups of {group_size}")
    gen = torch.Generator().manual_seed(seed)
    base = -math.log(vocab_size)
    samples = []
    for i, (p, r) in enumerate(lengths):
        ids = torch.randint(0, vocab_size, (p + r,), generator=gen)
        behav = base + 0.1 * torch.randn(r, generator=gen)
        samples.append(
            Sample(
                prompt_ids=tuple(ids[:p].tolist()), response_ids=tuple(ids[p:].tolist()),
                behav_logprobs=tuple(behav.tolist()), group_id=i // group_size,
            )
        )  # fmt: skip
    rewards = torch.randn(len(lengths) // group_size, group_size, generator=gen)
    if group_size > 1:
        rewards = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    batch = pack_samples(samples, rewards.flatten())
    # Old log-probs differ from the behaviour ones (a proximal policy one update later).
    noise = 0.05 * torch.randn(batch.num_tokens, generator=gen)
    old = torch.where(batch.loss_mask, batch.behav_logprobs + noise, torch.zeros(()))
    return batch.with_(old_logprobs=old)
