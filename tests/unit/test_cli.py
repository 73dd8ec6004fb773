"""The command line: config errors exit with status 2 and name the key."""

from slipstream.cli import main


def test_unknown_key_is_reported(capsys):
    assert main(["train", "recipes/demo.yaml", "actor.lrr=1e-6"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'actor.lrr'; did you mean 'actor.lr'?" in err


def test_bad_value_is_reported(capsys):
    assert main(["train", "rollout.group_size=many"]) == 2
    assert "rollout.group_size must be an integer" in capsys.readouterr().err


def test_report_command(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.7}\n')
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").stat().st_size > 1000


def test_errors_found_while_building_the_run_are_reported(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["train", "recipes/demo.yaml", f"data.source={missing}", f"trainer.run_dir={tmp_path}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "recipes/demo.yaml", "reward.functions=[maths]", f"trainer.run_dir={tmp_path}"]) == 2
    assert "did you mean 'math'" in capsys.readouterr().err


def test_resume_false_refuses_a_run_dir_with_checkpoints(tmp_path, capsys):
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    assert main(["train", "recipes/demo.yaml", f"trainer.run_dir={tmp_path}", "trainer.resume=false"]) == 2
    assert "trainer.resume=false" in capsys.readouterr().err


def test_eval_command_errors(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert "neither a run directory, a checkpoint directory nor a model path" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("trainer: {total_steps: 2}\n")
    assert main(["eval", str(tmp_path)]) == 2  # a run directory without checkpoints
    assert "has no checkpoint" in capsys.readouterr().err
