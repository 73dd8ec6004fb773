"""Rollout engine interface: sampling parameters and the protocol every generator implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Protocol, runtime_checkable

import torch

from slipstream.batching.records import Sample


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions.

    Behaviour log-probs are always log_softmax(logits / temperature) at the sampled token,
    before top-k / top-p truncation: the same quantity the trainer recomputes, so importance
    ratios compare like with like. temperature == 0 means greedy decoding, and its
    log-probs are then taken at temperature 1.
    """

    temperature: float = 1.0
    """Divides the logits before softmax; 0 selects greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1) disables the filter."""
    max_new_tokens: int = 256
    """Generation budget per completion; hitting it gives finish_reason "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion (kept in response_ids, finish_reason "stop")."""
    n: int = 1
    """Completions per prompt (one GRPO group)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1 disable it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        # Accept any iterable of ids (list from YAML) but store a hashable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RolloutReplica(Protocol):
    """What the trainer does with any holder of the rollout's copy of the policy: sync weights into it, free
    its memory around training, checkpoint its counters. `BuiltinRollout` (in process) and
    `controller/placement.py:RemoteRollout` (the trainer's view of the rollout ranks) are both one."""

    device: torch.device
    """Where the rollout computes (the trainer waits on it before timing an eval)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF-named weights (as TrainEngine.export_weights yields) and tag later samples with version."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights, cache) while the trainer runs; the next `update_weights`
        brings the weights back (it wakes the engine)."""
        ...

    def wake(self) -> None:
        """Make room for the weights again (`update_weights` calls it after a sleep)."""
        ...

    def state_dict(self) -> dict:
        """What a resumed run needs to sample as this one would have (policy version, key counter)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class RolloutEngine(RolloutReplica, Protocol):
    """A replica that generates: prompts in, `Sample`s out, in one blocking call (the sync loop, evals)."""

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        keys: list[int] | None = None,
        budgets: list[list[int]] | None = None,
    ) -> list[list[Sample]]:
        """`sampling.n` samples per prompt; result[i] holds prompt i's samples, all with group_id i.

        keys[i] decides the randomness of prompt i's samples (with the engine's seed and the sample
        index), whatever else is generated alongside; None numbers the prompts on from the previous
        call. budgets[i][j], when given, replaces max_new_tokens for sample j of prompt i (and the
        number of samples of prompt i is len(budgets[i]))."""
        ...


@runtime_checkable
class StreamingRolloutEngine(Protocol):
    """An engine that takes requests while others are in flight and hands back samples as they finish
    (the async producer, `controller/producer.py`, drives it from its own thread, beside `update_weights`)."""

    @property
    def has_work(self) -> bool:
        """Whether any submitted sample has not been returned by `step` yet."""
        ...

    def submit(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        keys: list[int],
        tags: list[Hashable],
        budgets: list[list[int]] | None = None,
    ) -> None:
        """Queue `sampling.n` samples of each prompt (len(budgets[i]) with budgets), keyed as in
        `RolloutEngine.generate`; `step` returns each with its prompt's tag. Requests in flight must share
        `sampling`."""
        ...

    def step(self) -> list[tuple[Hashable, int, Sample]]:
        """One scheduling step; (tag, sample index, Sample) of every sample that finished in it."""
        ...
