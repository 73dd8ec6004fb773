"""The run fails loudly and usefully: NaN stops it, OOM names the setting, a bad reward never kills it."""

import json
import time

import pytest
import torch

from slipstream.config import load_config
from slipstream.controller.trainer import NonFiniteLoss, RLTrainer
from slipstream.engine.base import OutOfMemory

BASE = [
    "logging.tensorboard=false", "trainer.export_hf=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
    "eval.sets={}",  # evals: test_eval_run.py
]


def _trainer(tmp_path, *extra):
    return RLTrainer(load_config("recipes/demo.yaml", [f"trainer.run_dir={tmp_path}", *BASE, *extra]))


def test_non_finite_gradient_stops_the_run(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "trainer.total_steps=3")
    real = trainer.engine.optim_step

    def nan_on_second_step():
        metrics = real()
        if trainer.step_num == 1:
            metrics["actor/grad_norm"] = float("nan")
        return metrics

    monkeypatch.setattr(trainer.engine, "optim_step", nan_on_second_step)
    with pytest.raises(NonFiniteLoss, match="non-finite"):
        trainer.fit()
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # step 1 was logged, the bad step was not


def test_out_of_memory_names_the_setting(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "trainer.total_steps=1")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(trainer.engine.model, "forward", oom)
    with pytest.raises(OutOfMemory, match="lower actor.max_tokens_per_mb"):
        trainer.step()


def test_raising_reward_is_scored_and_the_run_goes_on(tmp_path):
    trainer = _trainer(
        tmp_path, "trainer.total_steps=2", "reward.functions=[tests/unit/rewards_fixtures.py:always_raising_reward]",
        "reward.timeout_s=5",
    )
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/error_frac"] for r in rows] == [1.0, 1.0]
    assert all(r["reward/mean"] == 0.0 for r in rows)
    assert [r["reward/always_raising_reward/error_frac"] for r in rows] == [1.0, 1.0]  # per function, too
    assert [r["reward/always_raising_reward/timeout_frac"] for r in rows] == [0.0, 0.0]


def test_out_of_memory_in_rollout_names_the_setting(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "trainer.total_steps=1")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(trainer.rollout, "generate", oom)
    with pytest.raises(OutOfMemory, match="lower rollout.gpu_memory_fraction .*rollout.max_batch_size"):
        trainer.step()


def test_a_stalled_step_dumps_every_thread_stack_and_goes_on(tmp_path, monkeypatch, caplog):
    trainer = _trainer(tmp_path / "run", "trainer.total_steps=2", "trainer.stall_dump_s=0.2")
    real = trainer.loop.step

    def step_stuck_in_a_wait(step_num):
        if step_num == 1:  # the second step waits 0.7 s in a function the dump must name
            _slow_collective_for_the_test(0.7)
        return real(step_num)

    monkeypatch.setattr(trainer.loop, "step", step_stuck_in_a_wait)
    with caplog.at_level("WARNING", logger="slipstream.controller.watch"):
        trainer.fit()
    stacks = (tmp_path / "run" / "stacks.txt").read_text()
    step2 = [d for d in stacks.split("=== ") if d.startswith("step 2 has run for ")]
    assert len(step2) >= 3  # 0.7 s of waiting at one dump per 0.2 s (the rest of the step may add more)
    assert "_slow_collective_for_the_test" in step2[0] and "step_stuck_in_a_wait" in step2[0]
    assert "Thread 0x" in step2[0]  # every thread, not only the main one
    assert trainer.step_num == 2  # the run went on
    dumps = trainer.stall.dumps
    time.sleep(0.5)
    assert trainer.stall.dumps == dumps  # the watch ended with the run
    assert any("stall_dump_s=0.2" in r.getMessage() and "stacks.txt" in r.getMessage() for r in caplog.records)


def _slow_collective_for_the_test(seconds: float) -> None:
    time.sleep(seconds)


def test_a_prompt_longer_than_the_context_is_skipped_in_training_and_the_step_0_eval(tmp_path):
    # the default eval set is the training source, and data.max_prompt_length is unset: the over-long row
    # used to reach generate() at the step-0 eval and end the run
    data = tmp_path / "long.jsonl"
    rows = ["1+1=", "1+" * 1100 + "1=", "2+2=", "3+3=", "4+4="]
    data.write_text("".join(json.dumps({"prompt": r, "answer": "0"}) + "\n" for r in rows))
    trainer = RLTrainer(load_config("recipes/demo.yaml", [
        f"trainer.run_dir={tmp_path / 'run'}", "logging.tensorboard=false", "trainer.export_hf=false",
        f"data.source={data}", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "trainer.total_steps=1", "eval.sets={held: {size: 5}}", "eval.before_training=true",
    ]))  # fmt: skip
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["eval/held/filtered_prompts"] == 1.0 and records[0]["eval/held/num_problems"] == 4.0
