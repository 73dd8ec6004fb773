"""Atomic checkpoint directories and exact RNG restore."""

import random

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
    manager.save(4, lambda d: None, {"data": {"pos": 4}})
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    state = manager.load_trainer_state(manager.latest())
    assert state["step"] == 4 and state["data"] == {"pos": 4}
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
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
