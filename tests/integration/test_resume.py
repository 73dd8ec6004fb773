"""Resume continues exactly: 4 steps == 2 steps + resume + 2 steps (same losses, same rewards)."""

import json
import os
import signal

import pytest

from slipstream.config import load_config
from slipstream.controller.trainer import RLTrainer

KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl")


def _run(run_dir, steps):
    cfg = load_config(
        "recipes/demo.yaml",
        [
            f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "logging.tensorboard=false",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "algo.kl_coef=0.01",
            "algo.ppo_n_minibatches=2", "trainer.export_hf=false", "eval.sets={}",  # evals: test_eval_run.py
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


def test_interrupt_mid_step_finishes_the_step_then_saves(tmp_path, monkeypatch):
    """SIGINT in the middle of step 3 (between its two minibatch updates): the step completes, a
    checkpoint of step 3 is saved, and resuming gives exactly the uninterrupted run."""
    straight = _run(tmp_path / "a", 4)
    cfg_overrides = [
        f"trainer.run_dir={tmp_path / 'b'}", "trainer.total_steps=4", "logging.tensorboard=false",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "algo.kl_coef=0.01",
        "algo.ppo_n_minibatches=2", "trainer.export_hf=false", "eval.sets={}",
    ]
    trainer = RLTrainer(load_config("recipes/demo.yaml", cfg_overrides))
    real_optim_step = trainer.engine.optim_step
    calls = []

    def optim_step_with_signal():
        calls.append(trainer.step_num)
        if len(calls) == 5:  # first minibatch of step 3
            os.kill(os.getpid(), signal.SIGINT)
        return real_optim_step()

    monkeypatch.setattr(trainer.engine, "optim_step", optim_step_with_signal)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert len(calls) == 6  # the interrupted step ran its second minibatch too
    assert trainer.checkpoints.steps()[-1] == 3
    resumed = _run(tmp_path / "b", 4)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        for key in KEYS:
            assert a[key] == b[key], (a["step"], key)
