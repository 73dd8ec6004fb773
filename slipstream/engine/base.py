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


class LossFn(Protocol):
    """A pure loss over one micro-batch: (logprobs, entropy, micro_batch, global norm) -> (loss, metrics).

    `metrics` values are detached 0-dim tensors already divided by the global denominators,
    so the engine sums them over micro-batches to get minibatch values.
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
