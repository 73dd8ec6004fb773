"""Resume continues exactly: 4 steps == 2 steps + resume + 2 steps (same losses, same rewards)."""

import json

from slipstream.config import load_config
from slipstream.controller.grpo import RLTrainer

KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl")


def _run(run_dir, steps):
    cfg = load_config(
        "recipes/demo.yaml",
        [
            f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "trainer.tensorboard=false",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "algo.kl_coef=0.01",
            "algo.ppo_n_minibatches=2", "trainer.export_hf=false",
        ],
    )
    RLTrainer(cfg).fit()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_matches_uninterrupted(tmp_path):
    straight = _run(tmp_path / "a", 4)
    _run(tmp_path / "b", 2)
    resumed = _run(tmp_path / "b", 4)  # same run_dir: picks up the step-2 checkpoint
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        for key in KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_interrupt_saves_and_resumes(tmp_path, monkeypatch):
    """Ctrl-C during step 3 leaves the step-2 checkpoint; running again finishes like a straight run."""
    straight = _run(tmp_path / "a", 3)
    cfg_overrides = [
        f"trainer.run_dir={tmp_path / 'b'}", "trainer.total_steps=3", "trainer.tensorboard=false",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "algo.kl_coef=0.01",
        "algo.ppo_n_minibatches=2", "trainer.export_hf=false",
    ]
    trainer = RLTrainer(load_config("recipes/demo.yaml", cfg_overrides))
    real_step = trainer.step

    def step_then_interrupt():
        if trainer.step_num == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(trainer, "step", step_then_interrupt)
    try:
        trainer.fit()
        raise AssertionError("fit() should re-raise KeyboardInterrupt after saving")
    except KeyboardInterrupt:
        pass
    assert trainer.checkpoints.steps()[-1] == 2
    resumed = _run(tmp_path / "b", 3)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in KEYS:
        assert straight[-1][key] == resumed[-1][key], key
