"""Evals inside a run: the schedule survives an interrupt + resume exactly, and `slipstream eval` on the
final checkpoint reproduces the run's last eval scores."""

import json
import os
import signal

import pytest

from slipstream.cli import main
from slipstream.config import load_config
from slipstream.controller.trainer import RLTrainer

# the demo with a held-out eval set of two-term sums (100 problems, 24 held out), greedy and sampled
OVERRIDES = [
    "trainer.total_steps=6", "logging.tensorboard=false", "trainer.export_hf=false", "reward.num_workers=0",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "data.task_params={num_terms: 2}",
    "eval.sets={sums: {size: 24}}", "eval.every_steps=2", "eval.n=4", "eval.pass_k=[1, 4]",
]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _evals(records):
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in records if "eval/sums/accuracy" in r}


def test_resumed_run_continues_the_eval_schedule_and_eval_reproduces_it(tmp_path, monkeypatch, capsys):
    straight_dir = tmp_path / "a"
    RLTrainer(load_config("recipes/demo.yaml", [f"trainer.run_dir={straight_dir}", *OVERRIDES])).fit()
    straight = _evals(_records(straight_dir))
    assert sorted(straight) == [0, 2, 4, 6]
    assert all(r["eval/sums/held_out"] == 1.0 and r["eval/sums/num_problems"] == 24 for r in straight.values())
    step_records = [r for r in _records(straight_dir) if "perf/step_time" in r]
    assert all("perf/eval_time" not in r or r["step"] in straight for r in step_records)

    # interrupted during step 3 (after the step-2 eval), then resumed
    trainer = RLTrainer(load_config("recipes/demo.yaml", [f"trainer.run_dir={tmp_path / 'b'}", *OVERRIDES]))
    real_step = trainer.loop.step

    def step_with_signal(step_num):
        if step_num == 2:  # the loop's step 3
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(step_num)

    monkeypatch.setattr(trainer.loop, "step", step_with_signal)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert trainer.checkpoints.steps()[-1] == 3
    RLTrainer(load_config("recipes/demo.yaml", [f"trainer.run_dir={tmp_path / 'b'}", *OVERRIDES])).fit()
    resumed = _evals(_records(tmp_path / "b"))
    assert resumed == straight  # the same steps, none repeated or skipped, the same scores

    # `slipstream eval RUN_DIR` scores the final checkpoint: the run's last eval, every metric
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main(["eval", str(straight_dir), "--out", str(out)]) == 0
    scored = json.loads(out.read_text())
    assert scored["step"] == 6
    assert {k: v for k, v in scored.items() if k.startswith("eval/")} == straight[6]
    assert "eval step 6 | sums (24 problems)" in capsys.readouterr().out
