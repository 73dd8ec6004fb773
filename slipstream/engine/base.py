"""The TrainEngine interface: the only surface the RL loop sees of a training backend.

Algorithm code never branches on the backend. A backend owns the model's parameters, their
sharding and precision, the optimizer, and the collective that turns per-rank token counts
into the global loss denominators.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from slipstream.batching.records import LossNorm, PackedBatch


@dataclass(frozen=True)
class LogProbOutput:
    """Per-token results of a forward pass over one micro-batch, aligned to its positions."""

    logprobs: torch.Tensor  # (T,) float32
    entropy: torch.Tensor | None  # (T,) float32, only when asked for


MAX_METRIC_SUFFIX = "_max"
"""Loss metrics named `..._max` are maxima: reduced with max over micro-batches and ranks, not summed."""


def accumulate_metrics(totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Fold one micro-batch's loss metrics into `totals`: sums, and maxima for `..._max` keys."""
    for key, value in metrics.items():
        value = value.detach().float()
        if key not in totals:
            totals[key] = value
        elif key.endswith(MAX_METRIC_SUFFIX):
            totals[key] = torch.maximum(totals[key], value)
        else:
            totals[key] = totals[key] + value


def reduce_metrics(totals: dict[str, torch.Tensor], device: torch.device, sum_over_ranks, max_over_ranks) -> dict[str, float]:
    """Minibatch metrics from this rank's totals: one collective (and one host sync) per reduction kind.

    Keys are sorted, so every rank stacks the same metrics in the same order."""
    result: dict[str, float] = {}
    for reduce, keys in (
        (max_over_ranks, sorted(k for k in totals if k.endswith(MAX_METRIC_SUFFIX))),
        (sum_over_ranks, sorted(k for k in totals if not k.endswith(MAX_METRIC_SUFFIX))),
    ):
        if keys:
            values = reduce(torch.stack([torch.as_tensor(totals[k], device=device) for k in keys]))
            result.update(zip(keys, values.tolist()))
    return result


class LossFn(Protocol):
    """A pure loss over one micro-batch: (logprobs, entropy, micro_batch, global norm) -> (loss, metrics).

    `metrics` values are detached 0-dim tensors already divided by the global denominators,
    so the engine sums them over micro-batches to get minibatch values (`..._max` metrics are
    maxima instead; see `accumulate_metrics`).
    """

    needs_entropy: bool

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch, norm: LossNorm
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class TrainEngine(Protocol):
    device: torch.device
    dp_rank: int
    """This process's data-parallel rank: which share of a minibatch's plan it trains on."""
    dp_size: int
    """Data-parallel ranks (1 in one process)."""

    def forward_logprobs(
        self, micro_batches: Sequence[PackedBatch], *, with_entropy: bool = False
    ) -> list[LogProbOutput]:
        """No-grad log-probs (and entropy) of every micro-batch, in order."""
        ...

    def forward_backward(
        self, micro_batches: Sequence[PackedBatch], loss_fn: LossFn, *, max_response_len: int
    ) -> dict[str, float]:
        """Accumulate gradients of one minibatch, normalised by its global token / sequence counts."""
        ...

    def optim_step(self) -> dict[str, float]:
        """Clip, check finiteness, step the optimizer and the LR schedule; returns grad_norm and lr."""
        ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under HF names, for rollout weight sync and HF export."""
        ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def offload(self) -> None:
        """Move parameters and optimizer state off the accelerator (colocated rollout)."""
        ...

    def onload(self) -> None: ...
