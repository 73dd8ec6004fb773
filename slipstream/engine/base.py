"""The TrainEngine interface: the only surface the RL loop sees of a training backend.

Algorithm code never branches on the backend. A backend owns the model's parameters, their
sharding and precision, the optimizer, and the collective that turns per-rank token counts
into the global loss denominators.

The pieces every backend shares live here too (token counting, the LossNorm, metric
reduction, the out-of-memory advice), so no backend imports another backend's module.
"""

from __future__ import annotations

import contextlib
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


class OutOfMemory(RuntimeError):
    """Raised with the setting to change when a micro-batch does not fit."""


@contextlib.contextmanager
def oom_advice(setting: str, micro_batches: Sequence[PackedBatch]):
    """Turn a CUDA OOM into an OutOfMemory that names the setting to lower."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        largest = max(mb.num_tokens for mb in micro_batches)
        raise OutOfMemory(
            f"out of memory with micro-batches of up to {largest} tokens; lower {setting} "
            f"(or shorten rollout.max_new_tokens). Original error: {err}"
        ) from err


def count_loss_tokens(micro_batches: Sequence[PackedBatch]) -> tuple[int, int]:
    """(loss tokens, sequences with at least one loss token) of micro-batches, from CPU-side masks.

    A sequence counts for the seq-mean modes when it has at least one loss token, so padding
    sequences and empty responses do not dilute the mean. Distributed backends all-reduce
    these two counts (over gloo, no device sync) before calling `make_norm`.
    """
    num_tokens = 0
    num_seqs = 0
    for mb in micro_batches:
        mask = mb.loss_mask.cpu()
        num_tokens += int(mask.sum())
        has_tokens = torch.zeros(mb.num_seqs, dtype=torch.bool).index_fill_(0, mb.seq_index.cpu()[mask], True)
        num_seqs += int(has_tokens.sum())
    return num_tokens, num_seqs


def make_norm(num_tokens: float, num_seqs: float, max_response_len: int) -> LossNorm:
    """LossNorm from global counts; an empty minibatch divides by 1 (its numerator is 0 too)."""
    return LossNorm(num_loss_tokens=max(num_tokens, 1), num_seqs=max(num_seqs, 1), max_response_len=max_response_len)


def count_norm(micro_batches: Sequence[PackedBatch], max_response_len: int) -> LossNorm:
    """Global loss denominators of a single-process minibatch from its CPU-side masks (no device sync)."""
    return make_norm(*count_loss_tokens(micro_batches), max_response_len)


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
