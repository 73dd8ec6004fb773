"""Eval metrics from per-problem results: accuracy, mean@n, pass@k (unbiased), maj@n."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Completion:
    """One scored eval completion."""

    score: float
    correct: bool
    answer: str | None
    """The extracted answer, normalised for majority voting (None when nothing was extracted)."""
    response_len: int
    truncated: bool
    """It hit the generation budget before a stop token."""


@dataclass(frozen=True)
class ProblemResult:
    """The completions of one eval problem: the greedy one (if run) and the n sampled ones."""

    index: int
    greedy: Completion | None
    samples: tuple[Completion, ...] = ()


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct of n samples: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    Computed as a product, 1 - prod_{i=n-c+1..n} (1 - k / i), which stays exact in floats for
    large n where the binomials overflow.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_correct(samples: tuple[Completion, ...]) -> bool:
    """Whether the most frequent extracted answer is correct (ties: the answer seen first).

    Samples without an answer do not vote; all samples of one answer share its correctness when
    the reward depends only on the extracted answer, which is what makes maj@n meaningful.
    """
    votes = Counter(s.answer for s in samples if s.answer is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(s for s in samples if s.answer is not None and votes[s.answer] == top)
    return winner.correct


def set_metrics(name: str, results: list[ProblemResult], pass_k: list[int]) -> dict[str, float]:
    """eval/<name>/... over the problems of one set."""
    prefix = f"eval/{name}/"
    out: dict[str, float] = {f"{prefix}num_problems": float(len(results))}
    greedy = [r.greedy for r in results if r.greedy is not None]
    if greedy:
        out[f"{prefix}accuracy"] = sum(c.correct for c in greedy) / len(greedy)
        out[f"{prefix}reward"] = sum(c.score for c in greedy) / len(greedy)
    sampled = [r.samples for r in results if r.samples]
    if sampled:
        n = len(sampled[0])
        out[f"{prefix}mean@{n}"] = sum(sum(c.correct for c in s) for s in sampled) / (n * len(sampled))
        for k in pass_k or sorted({1, n}):
            out[f"{prefix}pass@{k}"] = sum(pass_at_k(n, sum(c.correct for c in s), k) for s in sampled) / len(sampled)
        out[f"{prefix}maj@{n}"] = sum(majority_correct(s) for s in sampled) / len(sampled)
    # lengths and truncation of the greedy completions when there are any, else of the samples
    shown = greedy or [c for s in sampled for c in s]
    if shown:
        out[f"{prefix}resp_len"] = sum(c.response_len for c in shown) / len(shown)
        out[f"{prefix}truncated_frac"] = sum(c.truncated for c in shown) / len(shown)
    return out
