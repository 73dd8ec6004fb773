"""Typed records that travel between the stages of one RL step.

Token alignment convention for `PackedBatch` (used everywhere in slipstream):
position t of a packed batch *predicts* `targets[t]`, the next token of the same
sequence. Every per-token array (`loss_mask`, `advantages`, `old_logprobs`, ...) is
indexed by that predicting position. The last position of each sequence has no
target: its `targets` entry is 0 and its `loss_mask` is False.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt, as produced by a rollout engine and scored by rewards."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    behav_logprobs: tuple[float, ...]
    """Log-probs of `response_ids` under the policy that sampled them (len == len(response_ids))."""
    group_id: int = 0
    """Completions of the same prompt share a group id (GRPO normalises within a group)."""
    finish_reason: str = "length"
    """"stop" when a stop token ended the completion, "length" when max_new_tokens did."""
    version: int = 0
    """Policy version of the oldest token: the number of weight syncs the rollout had received when it sampled it."""
    token_versions: tuple[int, ...] = ()
    """Policy version of each response token (weights may change while a sample is in flight); () = all `version`."""
    prompt_index: int = -1
    """Position of the prompt in the run's data stream (-1: not from a stream)."""
    prompt_text: str = ""
    response_text: str = ""
    answer: str | None = None
    """Ground truth carried from the dataset row to the reward function."""
    reward: float = 0.0
    reward_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.behav_logprobs) != len(self.response_ids):
            raise ValueError(
                f"behav_logprobs has {len(self.behav_logprobs)} entries for "
                f"{len(self.response_ids)} response tokens"
            )
        if self.token_versions and len(self.token_versions) != len(self.response_ids):
            raise ValueError(
                f"token_versions has {len(self.token_versions)} entries for {len(self.response_ids)} response tokens"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated without padding; attention never crosses `cu_seqlens` boundaries.

    Shapes: T = total tokens, n = number of sequences.
    """

    input_ids: torch.Tensor  # (T,) int64
    position_ids: torch.Tensor  # (T,) int64, restarts at 0 for every sequence
    cu_seqlens: torch.Tensor  # (n+1,) int32, cumulative sequence lengths starting at 0
    max_seqlen: int
    targets: torch.Tensor  # (T,) int64, next token of the same sequence (0 at each sequence end)
    loss_mask: torch.Tensor  # (T,) bool, True where targets[t] is a response token
    seq_index: torch.Tensor  # (T,) int64, which sequence (0..n-1) position t belongs to
    advantages: torch.Tensor  # (T,) float32, 0 outside the loss mask
    old_logprobs: torch.Tensor | None = None  # (T,) float32, policy before this update
    ref_logprobs: torch.Tensor | None = None  # (T,) float32, reference model
    behav_logprobs: torch.Tensor | None = None  # (T,) float32, rollout engine's log-probs
    fresh_mask: torch.Tensor | None = None
    """(T,) bool: response tokens sampled with the weights the trainer holds before this update (None: all)."""
    sample_ids: tuple[int, ...] = ()
    """Index of each packed sequence in the list it was packed from (for scattering results back)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=non_blocking)
            moved[f.name] = value
        return PackedBatch(**moved)

    def with_(self, **changes) -> "PackedBatch":
        return replace(self, **changes)


@dataclass(frozen=True)
class LossNorm:
    """Global denominators of one minibatch (all micro-batches, all data-parallel ranks).

    Losses divide by these rather than by per-micro-batch counts, so the loss and its
    gradient do not depend on how the minibatch was split.
    """

    num_loss_tokens: float
    num_seqs: float
    max_response_len: float
    """Constant used by seq-mean-token-sum-norm (Dr.GRPO): the generation budget."""


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which sequences (indices into a minibatch) go to which rank and micro-batch."""

    assignments: tuple[tuple[tuple[int, ...], ...], ...]
    """assignments[rank][micro_batch] = indices of sequences."""
    max_tokens_per_mb: int

    @property
    def num_ranks(self) -> int:
        return len(self.assignments)

    @property
    def num_micro_batches(self) -> int:
        return len(self.assignments[0]) if self.assignments else 0
