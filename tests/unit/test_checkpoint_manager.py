"""Atomic checkpoint directories, exact RNG restore, and no code run while loading one."""

import os
import random

import numpy as np
import pytest
import torch

from slipstream.checkpoint.manager import CheckpointManager


def test_atomic_save_keep_last_and_rng(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest() is None
    for step in (1, 2, 3):
        manager.save(step, lambda d: (d / "engine.pt").write_bytes(b"x"), {"data": {"pos": step}})
    assert manager.steps() == [2, 3]
    # a crash mid-save leaves a .tmp directory that is never taken for a checkpoint
    (tmp_path / "step_000004.tmp").mkdir()
    assert manager.latest().name == "step_000003"

    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    manager.save(4, lambda d: None, {"data": {"pos": 4}})
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    state = manager.load_trainer_state(manager.latest())
    assert state["step"] == 4 and state["data"] == {"pos": 4}
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2]
    assert not (tmp_path / "step_000004.tmp").exists()


def test_resaving_a_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(3, lambda d: (d / "engine.pt").write_bytes(b"first"), {})
    manager.save(3, lambda d: (d / "engine.pt").write_bytes(b"second"), {})
    assert manager.steps() == [3]
    assert (tmp_path / "step_000003" / "engine.pt").read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"]


def test_saved_rank_count(tmp_path):
    from slipstream.checkpoint.manager import saved_rank_count, trainer_file

    for rank in range(3):
        (tmp_path / trainer_file(rank)).write_bytes(b"")
    assert saved_rank_count(tmp_path) == 3


class _Planted:
    """Unpickling this runs a shell command (what a checkpoint from a stranger could hold)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(1, lambda d: None, {"data": {"pos": 1}})
    marker = tmp_path / "code_ran"
    torch.save({"step": 1, "data": _Planted(marker), "rng": {}}, manager.latest() / "trainer.pt")
    with pytest.raises(ValueError, match=r"trainer.pt is refused: it holds Python objects .* \(it would call posix.system\)"):
        manager.load_trainer_state(manager.latest())
    assert not marker.exists()


def test_an_engine_file_that_would_run_code_is_refused(tmp_path):
    from slipstream.config.schema import ActorSection
    from slipstream.engine.local import LocalEngine
    from slipstream.models.presets import get_preset
    from slipstream.models.transformer import Transformer

    engine = LocalEngine(Transformer(get_preset("tiny")), torch.device("cpu"), torch.float32, 1.0, ActorSection())
    engine.save(tmp_path)
    marker = tmp_path / "code_ran"
    torch.save({"model": _Planted(marker)}, tmp_path / "engine.pt")
    # refused like trainer.pt, not torch's advice to rerun with weights_only=False
    with pytest.raises(ValueError, match=r"engine.pt is refused: it holds Python objects .* \(it would call posix.system\)"):
        engine.load(tmp_path)
    assert not marker.exists()


def test_a_checkpoint_of_the_older_format_still_loads(tmp_path):
    """Trainer state once held numpy's RNG keys as an array: loading it builds an array, no other code."""
    manager = CheckpointManager(tmp_path)
    manager.save(2, lambda d: None, {})
    np.random.seed(3)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = np.random.rand()
    torch.save({"step": 2, "data": {"pos": 2}, "rng": old}, manager.latest() / "trainer.pt")
    np.random.seed(4)
    assert manager.load_trainer_state(manager.latest())["step"] == 2
    assert np.random.rand() == expected


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_an_interrupted_save_leaves_nothing_behind(tmp_path, error):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(2, lambda d: (d / "model.pt").write_bytes(b"weights"), {"position": 2})

    def write(directory):
        (directory / "model.pt").write_bytes(b"half")
        raise error("stopped mid-save")

    with pytest.raises(error):
        manager.save(4, write, {"position": 4})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]  # no step_000004.tmp
    assert manager.latest() == tmp_path / "step_000002"
