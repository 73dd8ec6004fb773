"""Ctrl-C and restarts as a user meets them: `slipstream train` in a subprocess, SIGINT to its process group.

A terminal sends Ctrl-C to the whole foreground process group (the trainer and its reward workers), so the
tests start the trainer in a session of its own and signal the group. The first Ctrl-C finishes the step,
saves and exits 130; a second one stops at once without a checkpoint; a resumed run's metrics.jsonl has one
row per step; start-up interrupts print one line. The run directory checks need no subprocess.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from slipstream.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "unit" / "rewards_fixtures.py"
FAST = ["rollout.prompts_per_step=4", "rollout.group_size=4", "logging.tensorboard=false", "trainer.export_hf=false",
        "logging.log_every=1"]  # fmt: skip
# 16 completions x 40 ms: a step takes long enough to be caught in the middle (inline, so Ctrl-C reaches it)
SLOW = [f"reward.functions=[{FIXTURES}:slow_exact_reward]", "reward.num_workers=0"]


class Trainer:
    """`slipstream train recipes/demo.yaml ...` in its own process group, its output read line by line."""

    def __init__(self, run_dir: Path, *overrides: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream.cli", "train", "recipes/demo.yaml", f"trainer.run_dir={run_dir}",
             *FAST, *overrides],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, f"exited before printing {text!r}:\n{self.output}"
            self.lines.append(line)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # what a terminal sends: the whole process group

    def finish(self, timeout: float = 120.0) -> int:
        code = self.proc.wait(timeout)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def _steps(run_dir: Path, name: str = "metrics.jsonl") -> list[int]:
    """The steps of the training rows (the demo's eval rows, with eval/* metrics only, are left out)."""
    rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
    return [row["step"] for row in rows if "reward/mean" in row]


def _train(run_dir: Path, *overrides: str) -> int:
    return main(["train", "recipes/demo.yaml", f"trainer.run_dir={run_dir}", *FAST, *overrides])


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    trainer = Trainer(tmp_path / "run")
    maps, deadline = Path(f"/proc/{trainer.proc.pid}/maps"), time.monotonic() + 120
    while "libtorch" not in maps.read_text():  # inside `slipstream train`: importing torch, then the model
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output
        time.sleep(0.01)
    trainer.ctrl_c()
    assert trainer.finish() == 130
    assert trainer.output.strip() == "interrupted during start-up: no step was run, nothing was saved", trainer.output


def test_ctrl_c_while_reward_workers_start_prints_no_traceback(tmp_path):
    trainer = Trainer(tmp_path / "run", "reward.num_workers=2", "trainer.total_steps=3")
    deadline = time.monotonic() + 120
    children = Path(f"/proc/{trainer.proc.pid}/task/{trainer.proc.pid}/children")
    while not children.read_text().strip():  # the workers are spawned (and importing)
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.output
        time.sleep(0.01)
    trainer.ctrl_c()
    assert trainer.finish() == 130
    assert "Traceback" not in trainer.output and "KeyboardInterrupt" not in trainer.output, trainer.output
    assert "interrupted" in trainer.output


def test_ctrl_c_saves_and_a_rerun_continues_the_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    trainer = Trainer(run, "trainer.total_steps=6", *SLOW)
    trainer.wait_for("step 2 |")
    trainer.ctrl_c()
    assert trainer.finish() == 130
    saved = sorted((run / "checkpoints").iterdir())[-1].name
    assert f"interrupted: checkpoint {saved} saved" in trainer.output and "Traceback" not in trainer.output
    stopped_at = int(saved.removeprefix("step_"))
    assert stopped_at >= 2 and _steps(run) == list(range(1, stopped_at + 1))

    # resumes with the demo's own, fast reward: a change of config a resume refuses unless asked
    assert _train(run, "trainer.total_steps=6") == 2
    assert _train(run, "trainer.total_steps=6", "--allow-config-change") == 0
    assert _steps(run) == [1, 2, 3, 4, 5, 6]
    capsys.readouterr()
    assert _train(run, "trainer.total_steps=6") == 0  # nothing left to do
    assert "is complete: its newest checkpoint is at step 6 = trainer.total_steps" in capsys.readouterr().out


def test_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(run, "trainer.total_steps=8", "trainer.save_every=2", *SLOW)
    trainer.wait_for("step 3 |")
    trainer.ctrl_c()
    trainer.wait_for("stop requested")
    trainer.ctrl_c()
    assert trainer.finish() == 130
    assert "no checkpoint was written" in trainer.output and "step_000002" in trainer.output, trainer.output
    assert "checkpoint step_000004 saved" not in trainer.output and "Traceback" not in trainer.output
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    assert _steps(run)[-1] >= 3  # steps logged after the checkpoint

    assert _train(run, "trainer.total_steps=4", "--allow-config-change") == 0  # resumes from step 2, fast reward
    assert _steps(run) == [1, 2, 3, 4]  # one row per step: the rows after step 2 were moved aside
    assert 3 in _steps(run, "metrics.dropped.jsonl")


def test_run_dir_checks(tmp_path, capsys):
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')  # a training row
    assert _train(earlier, "trainer.total_steps=1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err and "pick a new trainer.run_dir" in err, err
    assert main(["train", "recipes/demo.yaml", "--overwrite", f"trainer.run_dir={earlier}", *FAST,
                 "trainer.total_steps=1"]) == 0  # fmt: skip
    assert _steps(earlier) == [1]

    (tmp_path / "ahead" / "checkpoints" / "step_000005").mkdir(parents=True)
    assert _train(tmp_path / "ahead", "trainer.total_steps=3") == 2
    err = capsys.readouterr().err
    assert "trainer.total_steps=3 is below step 5 of the newest checkpoint" in err

    (tmp_path / "done" / "checkpoints" / "step_000003").mkdir(parents=True)
    assert _train(tmp_path / "done", "trainer.total_steps=3") == 0
    assert "is complete" in capsys.readouterr().out


def test_a_rerun_finishes_the_export_and_report_a_stop_after_the_final_checkpoint_left_out(tmp_path, capsys):
    """A kill between the final checkpoint and the end leaves no hf/ and no report.png: the rerun writes
    both (the export from that checkpoint, the same weights) and says so; a further rerun has nothing to do."""
    run = tmp_path / "run"
    assert _train(run, "trainer.total_steps=2", "trainer.export_hf=true") == 0
    exported = {p.name: p.read_bytes() for p in (run / "hf").glob("*.safetensors")}
    assert exported
    shutil.rmtree(run / "hf")  # what the kill right after saving step_000002 leaves
    (run / "report.png").unlink()
    capsys.readouterr()
    assert _train(run, "trainer.total_steps=2", "trainer.export_hf=true") == 0
    out = capsys.readouterr().out
    assert "was complete at step 2" in out and "HF export" in out and "report" in out, out
    assert {p.name: p.read_bytes() for p in (run / "hf").glob("*.safetensors")} == exported
    assert (run / "report.png").is_file() and _steps(run) == [1, 2]

    (run / "report.png").unlink()  # only the report missing: written without building the run
    assert _train(run, "trainer.total_steps=2", "trainer.export_hf=true") == 0
    out = capsys.readouterr().out
    assert "is complete" in out and "wrote the report it was missing" in out and (run / "report.png").is_file()
    assert _train(run, "trainer.total_steps=2", "trainer.export_hf=true") == 0
    assert "wrote" not in capsys.readouterr().out


@pytest.mark.parametrize("tail", ['{"step": 3, "rew', ""])
def test_rewind_metrics(tmp_path, tail):
    from slipstream.controller.run_dir import rewind_metrics

    rows = "".join(f'{{"step": {s}, "reward/mean": {s}}}\n' for s in (1, 2, 3, 4))
    (tmp_path / "metrics.jsonl").write_text(rows + tail)
    rewind_metrics(tmp_path, 2)
    assert _steps(tmp_path) == [1, 2]
    dropped = (tmp_path / "metrics.dropped.jsonl").read_text().splitlines()
    assert dropped[:2] == ['{"step": 3, "reward/mean": 3}', '{"step": 4, "reward/mean": 4}'] and len(dropped) == 2 + bool(tail)
