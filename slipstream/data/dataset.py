"""Resumable stream of prompt batches over a list of records or a procedural task.

The data is one endless stream of positions 0, 1, 2, ...; position p is record
`perm[epoch][p % N]` with epoch = p // N and a fresh seeded shuffle per epoch. Batches are
consecutive slices of the stream (they may straddle an epoch boundary), so the whole state is
(seed, position) and resuming from a checkpoint reproduces the remaining batches exactly.
"""

from __future__ import annotations

import random
from typing import Iterator, Sequence

from slipstream.data.sources import PromptRecord
from slipstream.data.tasks import Task


class PromptDataset:
    """Prompt batches with per-epoch shuffling and exact resume (`state_dict` / `load_state_dict`).

    For a task, position p is `task.sample(Random(f"{seed}:{p}"))`: every position is a fresh,
    reproducible prompt; `epoch_size` only sets how `epoch` is reported.
    """

    def __init__(
        self,
        source: Sequence[PromptRecord] | Task,
        seed: int = 0,
        shuffle: bool = True,
        epoch_size: int | None = None,
    ):
        if isinstance(source, Sequence):
            if len(source) == 0:
                raise ValueError("PromptDataset needs at least one record")
            if epoch_size is not None:
                raise ValueError("epoch_size is only for tasks; a record list's epoch is its length")
            self.records: list[PromptRecord] | None = list(source)
            self.task: Task | None = None
            self.epoch_size = len(self.records)
        else:
            if not callable(getattr(source, "sample", None)):
                raise ValueError(f"source must be a list of PromptRecord or a task, got {type(source).__name__}")
            if epoch_size is not None and epoch_size < 1:
                raise ValueError(f"epoch_size must be >= 1, got {epoch_size}")
            self.records = None
            self.task = source
            self.epoch_size = epoch_size or 1_000_000
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        """Number of records handed out so far (across epochs); the resume point."""
        self._perm_cache: tuple[int, int, list[int]] | None = None  # (seed, epoch, permutation)

    @property
    def epoch(self) -> int:
        return self.position // self.epoch_size

    def _permutation(self, seed: int, epoch: int) -> list[int]:
        if self._perm_cache is not None and self._perm_cache[:2] == (seed, epoch):
            return self._perm_cache[2]
        perm = list(range(self.epoch_size))
        if self.shuffle:
            # A string seed hashes deterministically (unlike hash() of a tuple across processes).
            random.Random(f"{seed}:epoch:{epoch}").shuffle(perm)
        self._perm_cache = (seed, epoch, perm)
        return perm

    def record_at(self, position: int, seed: int | None = None) -> PromptRecord:
        """The record at stream `position` for `seed` (default: the dataset's seed)."""
        seed = self.seed if seed is None else seed
        if self.task is not None:
            return self.task.sample(random.Random(f"{seed}:{position}"))
        assert self.records is not None
        epoch, offset = divmod(position, self.epoch_size)
        return self.records[self._permutation(seed, epoch)[offset]]

    def batches(
        self, batch_size: int, seed: int | None = None, start_index: int | None = None, num_batches: int | None = None
    ) -> Iterator[list[PromptRecord]]:
        """Endless (or `num_batches`) batches from stream position `start_index` (default: `position`).

        Passing `seed` replaces the dataset's seed. `position` advances as each batch is yielded,
        so `state_dict()` taken after consuming a batch resumes right after it.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if start_index is not None and start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {start_index}")
        if seed is not None:
            self.seed = seed
        if start_index is not None:
            self.position = start_index
        count = 0
        while num_batches is None or count < num_batches:
            start = self.position
            batch = [self.record_at(p) for p in range(start, start + batch_size)]
            self.position = start + batch_size
            count += 1
            yield batch

    def state_dict(self) -> dict:
        """Resume point: seed, position, and the data size it refers to."""
        return {"seed": self.seed, "position": self.position, "epoch": self.epoch,
                "epoch_size": self.epoch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Restore seed and position; ValueError if the data no longer matches the checkpoint."""
        if state["epoch_size"] != self.epoch_size:
            raise ValueError(
                f"checkpoint was taken over {state['epoch_size']} records per epoch, this dataset has "
                f"{self.epoch_size}: resuming would not reproduce the same batches"
            )
        if state["shuffle"] != self.shuffle:
            raise ValueError(f"checkpoint has shuffle={state['shuffle']}, this dataset shuffle={self.shuffle}")
        self.seed = state["seed"]
        self.position = state["position"]
