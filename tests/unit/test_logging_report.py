"""logging/ sinks and the report plot."""

from __future__ import annotations

import io
import json
import logging
import math

import numpy as np
import pytest
import torch
from rich.console import Console

from slipstream.logging import (
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    build_sinks,
    make_metrics_logger,
    make_tensorboard_sink,
    make_wandb_sink,
    read_metrics,
)
from slipstream.report import summarize, write_report


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_writes_flushes_and_appends(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"reward/mean": 0.5, "actor/kl": float("nan"), "perf/step_time": float("inf")})
    # Flushed per line: readable before close, as after a crash.
    first = _lines(path)
    assert len(first) == 1
    assert first[0]["step"] == 1 and first[0]["reward/mean"] == 0.5
    assert first[0]["actor/kl"] is None and first[0]["perf/step_time"] is None
    # the record carries the wall-clock time of logging: measured 1.4e-04 s; 5 s allows a slow CI machine
    assert first[0]["time"] == pytest.approx(__import__("time").time(), abs=5)
    sink.close()
    # A resumed run appends to the same file.
    sink = JsonlSink(path)
    sink.log(2, {"reward/mean": 0.75})
    sink.close()
    assert [r["step"] for r in _lines(path)] == [1, 2]
    with pytest.raises(ValueError, match="reserved"):
        JsonlSink(tmp_path / "x.jsonl").log(1, {"step": 3.0})


def test_read_metrics_dedups_resumed_steps_and_skips_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "time": 0, "a": 1.0}\n'
        '{"step": 2, "time": 0, "a": null}\n'
        '{"step": 2, "time": 1, "a": 5.0}\n'  # resumed from step 1: step 2 logged again
        '{"step": 3, "time": 1, "a": 6'  # killed mid-write
    )
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["a"] == 5.0
    path.write_text('{"step": 1, "a": null}\n{"step": 2, "a": 1.0}\n')
    assert math.isnan(read_metrics(path)[0]["a"])
    path.write_text('garbage\n{"step": 2}\n')
    with pytest.raises(ValueError, match="not a JSON line"):
        read_metrics(path)


class RecordingSink:
    def __init__(self):
        self.logged = []
        self.closed = 0

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


def test_metrics_logger_fans_out_and_converts(tmp_path):
    a, b = RecordingSink(), RecordingSink()
    logger = MetricsLogger([a, b])
    logger.log(3, {"x": torch.tensor(1.5), "y": np.float32(2.0), "z": 4})
    assert a.logged == b.logged == [(3, {"x": 1.5, "y": 2.0, "z": 4.0})]
    assert all(type(v) is float for v in a.logged[0][1].values())
    with pytest.raises(ValueError, match="'bad'"):
        logger.log(4, {"bad": "text"})
    logger.close()
    logger.close()
    assert a.closed == b.closed == 1
    with pytest.raises(RuntimeError):
        logger.log(5, {"x": 1.0})


def test_console_sink_prints_every_k_steps():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    sink = ConsoleSink(total_steps=4, print_every=2, console=console)
    sink.log(1, {"reward/mean": 0.25, "actor/pg_loss": -0.5, "perf/step_time": 1.0})
    sink.log(2, {"reward/mean": 0.75, "actor/pg_loss": -0.25, "perf/step_time": 1.5, "actor/kl": 0.001})
    sink.close()
    text = buf.getvalue()
    assert "step 2 | reward 0.75 | pg_loss -0.25 | kl 0.001 | step_s 1.5" in text
    assert "step 1 |" not in text  # step 1 is not a multiple of print_every
    assert ConsoleSink.format_line(7, {}) == "step 7"


def test_console_sink_lines_do_not_wrap_in_a_log_file():
    buf = io.StringIO()  # a file or pipe: rich assumes 80 columns there
    sink = ConsoleSink(total_steps=3, print_every=1, console=Console(file=buf, force_terminal=False))
    metrics = {"reward/mean": 0.123456, "actor/pg_loss": -0.0123, "actor/kl": 0.00123, "actor/entropy": 1.2345,
               "actor/grad_norm": 0.98765, "rollout/response_len_mean": 123.45, "perf/step_time": 12.345,
               "perf/rollout_time": 4.5678, "perf/actor_train_time": 6.789, "perf/actor_train_mfu": 0.4321}
    sink.log(1, metrics)
    sink.close()
    lines = [line for line in buf.getvalue().splitlines() if line.strip()]
    assert lines[0] == ConsoleSink.format_line(1, metrics) and len(lines[0]) > 80


def test_console_sink_resumed_run_and_alternate_keys():
    buf = io.StringIO()
    sink = ConsoleSink(total_steps=10, print_every=1, console=Console(file=buf, width=200), start_step=6)
    assert sink._progress.tasks[0].completed == 6
    sink.log(7, {"rollout/response_len_mean": 12.0})
    sink.close()
    assert "step 7 | resp_len 12" in buf.getvalue()


def test_build_sinks_as_the_controller_calls_it(tmp_path):
    sinks = build_sinks(tmp_path, total_steps=3, tensorboard=False, log_every=1, start_step=0)
    assert [type(s) for s in sinks] == [JsonlSink, ConsoleSink]
    with MetricsLogger(sinks) as logger:
        logger.log(1, {"reward/mean": 1.0})
    assert _lines(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 1.0


def test_make_metrics_logger_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    logger = make_metrics_logger(tmp_path, total_steps=2, console=False, tensorboard=True)
    logger.log(1, {"reward/mean": 0.1, "actor/kl": float("nan")})
    logger.close()
    assert _lines(tmp_path / "metrics.jsonl")[0]["actor/kl"] is None
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_optional_sinks_skip_when_missing(tmp_path, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with caplog.at_level(logging.INFO, logger="slipstream.logging.backends"):
        assert make_tensorboard_sink(tmp_path / "tb") is None
    assert "TensorBoard logging unavailable" in caplog.text
    monkeypatch.setattr(builtins, "__import__", real_import)

    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else object())
    with caplog.at_level(logging.WARNING, logger="slipstream.logging.backends"):
        assert make_wandb_sink("proj", tmp_path) is None
    assert "wandb is not installed" in caplog.text


def _synthetic_run(run_dir, num_steps=30, with_optional=True):
    rng = np.random.default_rng(0)
    with MetricsLogger([JsonlSink(run_dir / "metrics.jsonl")]) as logger:
        for step in range(1, num_steps + 1):
            m = {
                "reward/mean": step / num_steps + 0.1 * rng.standard_normal(),
                "actor/pg_loss": 0.01 * rng.standard_normal(),
                "perf/rollout_time": 3.0,
                "perf/actor_train_time": 1.5,
                "perf/update_weights_time": 0.2,
                "perf/step_time": 5.0,
            }
            if with_optional:
                m |= {
                    "actor/kl": 1e-3 * step,
                    "actor/entropy": float("nan") if step == 5 else 1.0 - 0.01 * step,
                    "perf/actor_train_tok_per_s": 5000.0,
                    "perf/actor_train_mfu": 0.35,
                    "perf/peak_tflops": 989.0,
                }
            logger.log(step, m)


def test_report_renders_png_and_summary(tmp_path, capsys):
    _synthetic_run(tmp_path)
    out = write_report(tmp_path, k=5)
    assert out == tmp_path / "report.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    text = capsys.readouterr().out
    assert "steps logged: 30" in text and "first 5 steps" in text


def test_report_with_missing_metrics(tmp_path):
    _synthetic_run(tmp_path, num_steps=3, with_optional=False)
    out = write_report(tmp_path)  # kl, entropy, throughput panels say "not logged"
    assert out.stat().st_size > 10_000
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert write_report(empty).is_file()
    with pytest.raises(ValueError, match="does not exist"):
        write_report(tmp_path / "missing")
    (tmp_path / "no_metrics").mkdir()
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        write_report(tmp_path / "no_metrics")


def test_summarize_first_vs_last_k():
    records = [{"step": i, "reward/mean": float(i)} for i in range(1, 11)]
    text = summarize(records, k=3)
    # first 3: mean(1,2,3) = 2; last 3: mean(8,9,10) = 9
    assert "first 3 steps 2.0000 -> last 3 steps 9.0000 (+7.0000)" in text
    assert summarize([{"step": 1}]).endswith("reward/mean: not logged")
    # Short run: windows shrink to stay disjoint (4 steps, k=10 -> first 2 vs last 2).
    short = [{"step": i, "reward/mean": float(i)} for i in range(1, 5)]
    assert "first 2 steps 1.5000 -> last 2 steps 3.5000" in summarize(short, k=10)


class _FakeWandb:
    """Stands in for the wandb module: records what the sink asks of it."""

    def __init__(self):
        self.init_kwargs, self.logged, self.finished = None, [], False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


def test_wandb_from_the_logging_section(tmp_path, monkeypatch):
    """logging.wandb reaches wandb.init (stand-in module); a resumed run continues the same W&B run."""
    import importlib.machinery
    import sys

    from slipstream.config import load_config
    from slipstream.controller.setup import build_metrics_logger

    fake = _FakeWandb()
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec("wandb") sees it
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(None, ["logging.wandb.enabled=true", "logging.wandb.mode=offline", "logging.wandb.tags=[x]",
                             "logging.wandb.project=p", "logging.tensorboard=false"])  # fmt: skip
    with build_metrics_logger(cfg, tmp_path, start_step=0) as logger:
        logger.log(1, {"reward/mean": 0.5})
    kw = fake.init_kwargs
    assert (kw["project"], kw["mode"], kw["tags"], kw["name"]) == ("p", "offline", ["x"], tmp_path.name)
    assert kw["config"]["logging"]["wandb"]["mode"] == "offline" and kw["dir"] == str(tmp_path)
    assert fake.logged == [(1, {"reward/mean": 0.5})] and fake.finished
    first_id = kw["id"]
    with build_metrics_logger(cfg, tmp_path, start_step=1):
        pass
    assert fake.init_kwargs["id"] == first_id and fake.init_kwargs["resume"] == "allow"
    (tmp_path / "fresh").mkdir()
    with build_metrics_logger(cfg, tmp_path / "fresh", start_step=0):
        pass
    assert fake.init_kwargs["id"] != first_id
    off = load_config(None, ["logging.tensorboard=false"])
    fake.init_kwargs = None
    with build_metrics_logger(off, tmp_path / "off", start_step=0):
        pass
    assert fake.init_kwargs is None  # off by default


def test_wandb_offline_run_writes_its_files(tmp_path):
    """The real wandb package in offline mode (skipped where wandb is not installed)."""
    pytest.importorskip("wandb")
    from slipstream.logging import WandbSink

    sink = WandbSink("slipstream-test", tmp_path, run_name="t", mode="offline", tags=["ci"])
    sink.log(1, {"reward/mean": 0.25})
    sink.log(2, {"reward/mean": 0.75})
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_summary_counts_training_steps_not_eval_rows():
    from slipstream.report import summarize

    rows = [{"step": 0, "eval/sum/accuracy": 0.0}] + [{"step": s, "reward/mean": 0.1 * s} for s in (1, 2, 3, 4)]
    rows.append({"step": 4, "eval/sum/accuracy": 1.0})
    assert summarize(rows).splitlines()[0] == "steps logged: 4 (step 1 .. 4)"


def test_report_panels_fit_the_run(tmp_path, monkeypatch):
    """A slow first step does not squash the step-time panel, a CPU run's throughput is not per GPU,
    and the title counts trained steps (not the step-0 eval row)."""
    from matplotlib.figure import Figure

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    rows = [{"step": 0, "eval/t/accuracy": 0.1, "perf/eval_time": 0.5}]
    for step in range(1, 201):
        rows.append({"step": step, "reward/mean": 0.5, "perf/rollout_time": 1.5 if step == 1 else 0.04,
                     "perf/step_time": 1.6 if step == 1 else 0.05, "perf/rollout_tokens_per_gpu_per_s": 900.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("trainer:\n  device: cpu\n")
    write_report(tmp_path)
    (fig,) = drawn
    assert fig.get_suptitle() == f"{tmp_path.name}: 200 steps"
    step_time, throughput = fig.axes[4], fig.axes[5]
    assert step_time.get_title().startswith("step time breakdown")
    assert 0.05 < step_time.get_ylim()[1] < 0.2  # scaled to the steady steps, not the 1.6 s warm-up
    assert any("step 1: 1.60 s" in t.get_text() for t in step_time.texts)  # marked in the panel
    assert "GPU" not in throughput.get_ylabel() and "CPU" in throughput.get_ylabel()
    assert all("GPU" not in t.get_text() for t in throughput.get_legend().get_texts())
