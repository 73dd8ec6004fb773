"""Run-health watches: warnings drawn from step metrics, and stack dumps of a step that stalls."""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


class StallWatch:
    """Writes the Python stack of every thread to `path` when one phase (a step, an eval) has run `after_s`
    seconds, and again every `after_s` while it lasts, with a warning naming the file; the run goes on.

    A run that stops making progress (a collective one rank never joins, a reward process that never
    answers, compilation that never ends) otherwise shows nothing but a silent progress bar. The dump
    runs on a watcher thread, so it needs the interpreter lock for a moment; `kill -USR1 <pid>`
    (registered by the CLI through faulthandler) prints the stacks without it.
    """

    def __init__(self, path: Path, after_s: float) -> None:
        self.path, self.after_s = path, after_s
        self.dumps = 0
        """Stack dumps written so far."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.after_s <= 0:
            yield
            return
        done = threading.Event()
        start = time.monotonic()

        def watch() -> None:
            while not done.wait(self.after_s):
                elapsed = time.monotonic() - start
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(f"=== {name} has run for {elapsed:.0f} s ({time.strftime('%Y-%m-%d %H:%M:%S')}): "
                            "the Python stack of every thread, most recent call first\n")  # fmt: skip
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
                    f.write("\n")
                self.dumps += 1
                log.warning("%s has run for %.0f s (trainer.stall_dump_s=%g): the Python stack of every thread is "
                            "in %s", name, elapsed, self.after_s, self.path)  # fmt: skip

        watcher = threading.Thread(target=watch, name="slipstream-stall-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()
