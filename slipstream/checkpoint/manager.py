"""Atomic checkpoints: write into a temporary directory, then rename it into place.

A checkpoint directory `step_000012/` holds the engine's own files (model, optimizer, scheduler)
plus `trainer.pt` with the step, the data position and every RNG state, so `resume`
continues exactly where the run stopped. A crash mid-save leaves only a `.tmp` directory,
which the next save of that step removes; `latest()` never returns a partial checkpoint.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = max(keep_last, 1)

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (STEP_DIR.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"step_{steps[-1]:06d}" if steps else None

    def save(self, step: int, write: Callable[[Path], None], trainer_state: dict[str, Any]) -> Path:
        """`write(tmp_dir)` stores the engine's files; trainer_state goes to trainer.pt."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer.pt")
        old = self.root / f"step_{step:06d}.old"
        if final.exists():  # re-saving the same step: move the old copy aside first, so a
            shutil.rmtree(old, ignore_errors=True)  # complete checkpoint exists at every moment
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        for old in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.root / f"step_{old:06d}", ignore_errors=True)
        return final

    @staticmethod
    def load_trainer_state(directory: Path) -> dict[str, Any]:
        state = torch.load(Path(directory) / "trainer.pt", weights_only=False)
        set_rng_state(state["rng"])
        return state
