"""Dynamic sampling (DAPO): a step trains groups whose rewards differ.

A group whose rewards are all equal has all-zero group-normalised advantages: it costs a training
pass and teaches nothing. With algo.dynamic_sampling on, such a group is dropped and the next prompt
of the stream takes its place, up to algo.dynamic_sampling_max_prompts extra prompts per step; past
that limit a zero-signal group is kept (with a warning), so every batch holds its prompts_per_step
groups. Replacement groups take the ids from prompts_per_step onwards, in the order the stream gives
their prompts; prompts drawn for replacements and not needed yet wait for the next step.

The sync loop sends a whole generated batch through `DynamicSampling.admit`; the async producer
sends each group as it finishes. The groups kept depend only on the rewards and on the stream's
order, not on the order in which groups finish, so the two loops keep the same groups.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from slipstream.batching.records import Sample
from slipstream.config.schema import Config
from slipstream.controller.prompts import PromptSource, TokenizedPrompt

log = logging.getLogger(__name__)


def has_signal(group: list[Sample]) -> bool:
    """Whether a group's rewards differ: with all rewards equal, group-normalised advantages are all 0."""
    return len({s.reward for s in group}) > 1


def check_supported(cfg: Config, world: int, disaggregated: bool = False) -> None:
    """Dynamic sampling draws its spare prompts from one process's stream, beside the trainer."""
    if cfg.algo.dynamic_sampling and world > 1:
        raise ValueError("algo.dynamic_sampling runs in one process only (each rank would draw the same spare prompts)")
    if cfg.algo.dynamic_sampling and disaggregated:
        raise ValueError("algo.dynamic_sampling is not supported with placement.rollout_ranks (the rollout ranks "
                         "would train every group)")  # fmt: skip


class SparePrompts:
    """Prompts of the stream drawn for replacements, handed out in stream order."""

    def __init__(self, prompts: PromptSource) -> None:
        self.prompts = prompts
        self._spare: list[TokenizedPrompt] = []

    def pop(self) -> TokenizedPrompt:
        if not self._spare:
            self._spare = list(self.prompts.next_batch())
        return self._spare.pop(0)


@dataclass
class DynamicSampling:
    """The filter of one step's batch: which groups it trains, and the replacements it asks for."""

    step: int
    first_extra_id: int
    """Group id of the first replacement (prompts_per_step: past the step's own groups)."""
    max_extra: int
    dropped: int = 0
    extra: int = 0

    @classmethod
    def for_step(cls, cfg: Config, step: int) -> "DynamicSampling":
        return cls(step, cfg.rollout.prompts_per_step, cfg.algo.dynamic_sampling_max_prompts)

    def admit(self, group: list[Sample], spares: SparePrompts) -> tuple[int, TokenizedPrompt] | None:
        """None: train `group`. Else it is dropped, and the (group id, prompt) to generate in its place."""
        if has_signal(group):
            return None
        if self.extra >= self.max_extra:
            log.warning("dynamic sampling: no prompt left for step %d after %d extra prompts; "
                        "training on a zero-advantage group", self.step + 1, self.extra)  # fmt: skip
            return None
        self.dropped += 1
        self.extra += 1
        return self.first_extra_id + self.extra - 1, spares.pop()

    def metrics(self) -> dict[str, float]:
        return {"async/dropped_zero_adv_groups": float(self.dropped), "async/extra_prompts": float(self.extra)}
