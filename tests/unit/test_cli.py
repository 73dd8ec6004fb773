"""The command line: config errors exit with status 2 and name the key (and the file and line)."""

import pytest

from slipstream.cli import main


def test_unknown_key_is_reported(capsys):
    assert main(["train", "recipes/demo.yaml", "actor.lrr=1e-6"]) == 2
    # the typo is on the command line, not at the recipe's (correct) `lr:` line
    assert capsys.readouterr().err == "command line: unknown config key 'actor.lrr'; did you mean 'actor.lr'?\n"


def test_bad_value_is_reported(capsys):
    assert main(["train", "recipes/demo.yaml", "rollout.group_size=many"]) == 2
    assert capsys.readouterr().err.startswith("command line: rollout.group_size must be an integer")


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


def test_train_without_a_recipe_lists_the_recipes(capsys):
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: slipstream train") and "Traceback" not in err
    assert "recipes/demo.yaml" in err and "README demo: a tiny from-scratch model" in err  # its first comment line
    assert main(["train", "actor.lr=1e-3"]) == 2  # overrides alone are no recipe either
    assert "recipes/demo.yaml" in capsys.readouterr().err


def test_yaml_errors_name_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\nrollout:\n  group_size: 4\n  stop: [a, b\ntrainer:\n  total_steps: 3\n")
    assert main(["train", str(bad)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith(f"{bad}:6:8: "), lines
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("model:\n  preset: tiny\nactor:\n  lrr: 1.0e-3\n")
    assert main(["train", str(unknown)]) == 2
    assert capsys.readouterr().err == f"{unknown}:4:3: unknown config key 'actor.lrr'; did you mean 'actor.lr'?\n"


def test_report_of_a_missing_run_dir_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"error: run directory '{tmp_path / 'nope'}' does not exist\n"
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_version_and_help_texts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("slipstream ")
    with pytest.raises(SystemExit):
        main(["bench", "train-step", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--warmup WARMUP untimed runs before the timed repeats" in help_text


def test_eval_command_errors(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert "neither a run directory, a checkpoint directory nor a model path" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("trainer: {total_steps: 2}\n")
    assert main(["eval", str(tmp_path)]) == 2  # a run directory without checkpoints
    err = capsys.readouterr().err
    assert f"{tmp_path} has no checkpoint and no hf/ export (it holds config.yaml)" in err
    assert str(tmp_path / "hf") not in err  # no path that does not exist is suggested
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert main(["eval", str(tmp_path)]) == 2
    assert f"{tmp_path} has no checkpoint; score its exported model: slipstream eval {tmp_path / 'hf'}" in capsys.readouterr().err


def test_resume_with_another_config_is_refused_unless_allowed(tmp_path, capsys):
    from slipstream.checkpoint.manager import CheckpointManager
    from slipstream.config.loader import dump_yaml, load_config

    run = tmp_path / "run"
    # no HF export: the stand-in checkpoint below holds no weights for a finishing rerun to export
    base = ["recipes/demo.yaml", f"trainer.run_dir={run}", "trainer.total_steps=2", "trainer.export_hf=false"]
    run.mkdir()
    dump_yaml(load_config(base[0], base[1:]), run / "config.yaml")
    CheckpointManager(run / "checkpoints").save(2, lambda d: None, {})
    before = sorted(p.name for p in run.iterdir())

    assert main(["train", *base, "actor.lr=3e-4", "rollout.group_size=4", "logging.tensorboard=false"]) == 2
    err = capsys.readouterr().err
    assert f"{run} holds a run with another config" in err
    assert "actor.lr: 0.001 -> 0.0003" in err and "rollout.group_size: 8 -> 4" in err
    assert "logging.tensorboard" not in err  # safe to change: not listed
    assert "slipstream train --allow-config-change" in err
    assert sorted(p.name for p in run.iterdir()) == before  # nothing was touched

    # keys safe to change (the length, logging, the eval schedule) resume without a word
    assert main(["train", *base, "logging.tensorboard=false", "eval.every_steps=5"]) == 0
    assert "is complete" in capsys.readouterr().out
    assert main(["train", *base, "actor.lr=3e-4", "--allow-config-change"]) == 0
    assert "is complete" in capsys.readouterr().out
