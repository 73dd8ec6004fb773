"""Run-health warnings drawn from step metrics."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class TruncationWatch:
    """Warns once per streak when `rollout/truncated_frac` stays above `threshold` for `window` steps.

    A truncated response hit rollout.max_new_tokens before a stop token: its answer may be cut
    off, and the reward then scores the budget rather than the policy. A one-token budget is a
    one-token answer format (the demo's), cut by design, so it is not warned about.
    """

    def __init__(self, max_new_tokens: int, window: int = 5, threshold: float = 0.5) -> None:
        self.max_new_tokens, self.window, self.threshold = max_new_tokens, window, threshold
        self.streak = 0

    def update(self, step: int, metrics: dict[str, float]) -> None:
        frac = metrics.get("rollout/truncated_frac")
        if frac is None or self.max_new_tokens == 1:
            return
        self.streak = self.streak + 1 if frac > self.threshold else 0
        if self.streak == self.window:
            log.warning(
                "step %d: rollout/truncated_frac has been above %.2f for %d steps (now %.2f): most responses hit "
                "rollout.max_new_tokens=%d before a stop token; raise it so that a whole answer fits",
                step, self.threshold, self.window, frac, self.max_new_tokens,
            )  # fmt: skip
