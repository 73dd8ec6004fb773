"""Atomic checkpoints: write into a temporary directory, then rename it into place.

A checkpoint directory `step_000012/` holds the engine's own files (model, optimizer, scheduler)
plus `trainer.pt` with the step, the data position and every RNG state, so `resume`
continues exactly where the run stopped. `trainer.pt` holds only tensors and plain Python
values and is read with `torch.load(weights_only=True)`: a file that would run code when
unpickled is refused (`load_plain`, which the engines' own `.pt` files go through too). (The fsdp
backend's DCP directory is another matter: torch reads its `.metadata` with plain pickle, see
docs/architecture.md.) A save that raises or is interrupted removes its
`.tmp` directory; a killed one leaves only the `.tmp` directory,
which the next save of that step removes; `latest()` never returns a partial checkpoint.

Several processes (a data-parallel run) save together: rank 0 makes and later renames the
directory, every rank writes its engine shards and its own trainer state (`trainer.pt` for
rank 0, `trainer_rank<r>.pt` for the others: each rank has its own rollout sampler), with
barriers in between.
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def rng_state() -> dict[str, Any]:
    """Every global RNG state as tensors and plain Python values (what `weights_only=True` reads back)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),  # (version, tuple of 625 ints, gauss_next): plain values already
        "numpy": (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state(),  # a uint8 tensor, as the CUDA states below
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]  # keys: a list, or an array in older checkpoints
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list:
    """What a pickled numpy array needs: building an array from its bytes runs no other code. Older
    checkpoints held the numpy RNG keys as an array; these let them load under weights_only=True."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


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

    def save(
        self,
        step: int,
        write: Callable[[Path], None],
        trainer_state: dict[str, Any],
        *,
        rank: int = 0,
        barrier: Callable[[], None] | None = None,
    ) -> Path:
        """`write(tmp_dir)` stores the engine's files; trainer_state goes to this rank's trainer file.

        With several processes every rank calls this with the same `step` and a `barrier` over all ranks.
        """
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        barrier = barrier or (lambda: None)  # one process: nothing to wait for
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()  # the directory exists before any rank writes
        if not tmp.is_dir():
            raise RuntimeError(
                f"rank {rank} cannot see {tmp}, made by rank 0: trainer.run_dir must be on a filesystem shared by all ranks"
            )
        try:
            write(tmp)
            torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / trainer_file(rank))
        except BaseException:  # an interrupted or failed save leaves nothing behind (a killed one: the .tmp)
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        barrier()  # every rank's files are in place before the rename
        if rank != 0:
            barrier()  # ... and the rename is done before any rank goes on
            return final
        old = self.root / f"step_{step:06d}.old"
        if final.exists():  # re-saving the same step: move the old copy aside first, so a
            shutil.rmtree(old, ignore_errors=True)  # complete checkpoint exists at every moment
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        for old in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.root / f"step_{old:06d}", ignore_errors=True)
        barrier()
        return final

    @staticmethod
    def load_trainer_state(directory: Path, rank: int = 0) -> dict[str, Any]:
        path = Path(directory) / trainer_file(rank)
        if not path.exists():
            raise ValueError(f"{directory} has no {path.name}: it was saved by fewer processes than this run has")
        with torch.serialization.safe_globals(_numpy_array_globals()):
            state = load_plain(path)
        set_rng_state(state["rng"])
        return state


def load_plain(path: Path, map_location: torch.device | str = "cpu") -> Any:
    """torch.load of a checkpoint file that may hold only tensors and plain data (every `.pt` slipstream
    writes: trainer state and the engines' files); ValueError if loading it would run code."""
    try:
        # weights_only: a pickled object that would run code is refused by torch's unpickler
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]+)", str(err))  # torch names the callable it refused
        what = f"it would call {named.group(1)}" if named else str(err).strip().splitlines()[0]
        raise ValueError(
            f"{path} is refused: it holds Python objects that loading would have to run as code ({what}); "
            "slipstream checkpoints hold only tensors and plain data. Resume only from checkpoints you trust, "
            "or start a new trainer.run_dir"
        ) from None


def trainer_file(rank: int) -> str:
    """Name of a rank's trainer state in a checkpoint directory."""
    return "trainer.pt" if rank == 0 else f"trainer_rank{rank}.pt"


def saved_rank_count(directory: Path) -> int:
    """How many processes saved the checkpoint in `directory` (one trainer file each)."""
    return len(list(Path(directory).glob("trainer*.pt")))
