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
