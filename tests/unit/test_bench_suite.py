"""`slipstream bench suite`: the registry, selection, results files, resume, and a CPU-sized run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import pytest

from slipstream.bench import registry, suite
from slipstream.bench.cli import add_bench_parser
from slipstream.bench.rows import FAIRNESS_KEYS

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "suite", *argv])


def test_registry_rows_are_named_and_unique():
    entries = suite._registry()
    assert {"w1", "w1-0.6b", "sizes", "backends", "memory-curve", "profile", "attention", "gpu-tests", "multi-gpu",
            "demo", "rl-step-demo", "plan-balance", "rollout", "rl-step-w1"} <= set(entries)  # fmt: skip
    for entry in entries.values():
        assert entry.description and entry.device in ("gpu", "cpu", "any")
        for quick in (False, True) if entry.has_quick else (False,):
            names = [r.name for r in entry.rows(quick)]
            assert names and len(set(names)) == len(names), entry.name
    full = [r.name for r in entries["w1"].rows(False)]
    # the W1 entry measures every comparison the docs quote, in one results file
    for name in ("slipstream-none", "slipstream-full", "naive-none", "naive-full", "trl-ckpt", "trl-liger-ckpt",
                 "trl-liger-no-ckpt", "verl-full", "logprob-op", "logprob-op-entropy"):  # fmt: skip
        assert name in full
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(entries["w1"])


def test_selection():
    names = lambda chosen: [e.name for e, _ in chosen]  # noqa: E731
    assert names(suite.select(None, gpu=False, quick=False)) == ["demo", "rl-step-demo", "plan-balance"]
    assert "w1" in names(suite.select(None, gpu=True, quick=False)) and "plan-balance" not in names(
        suite.select(None, gpu=True, quick=False)
    )
    ((entry, rows),) = suite.select(["w1/trl-ckpt", "w1/naive-full"], gpu=False, quick=False)
    assert entry.name == "w1" and rows == {"trl-ckpt", "naive-full"}
    ((entry, rows),) = suite.select(["w1/trl-ckpt", "w1"], gpu=False, quick=False)
    assert rows is None  # the whole entry wins
    with pytest.raises(ValueError, match="unknown suite entry 'w2'; entries: w1"):
        suite.select(["w2"], gpu=False, quick=False)


def test_gpu_entries_are_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "gpu_count", lambda: 0)  # suite.py's name for it: this machine has no GPU
    assert suite.run_suite_command(_args("--only", "profile", "multi-gpu", "--out", str(tmp_path))) == 0
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["status"] == "skipped" and profile["reason"] == "needs 1 CUDA GPU(s), found 0"
    assert json.loads((tmp_path / "multi-gpu.json").read_text())["reason"] == "needs 2 CUDA GPU(s), found 0"
    assert suite.run_suite_command(_args("--quick", "--only", "profile", "--out", str(tmp_path))) == 0
    assert "no CPU-sized version" in json.loads((tmp_path / "profile.json").read_text())["reason"]


def test_quick_w1_writes_one_file_with_like_for_like_ratios_and_resumes(tmp_path):
    rows = ["w1/slipstream-none", "w1/slipstream-full", "w1/naive-none", "w1/naive-full", "w1/trl-liger-ckpt",
            "w1/logprob-op-entropy"]  # fmt: skip
    assert suite.run_suite_command(_args("--quick", "--only", *rows, "plan-balance", "--out", str(tmp_path))) == 0
    record = json.loads((tmp_path / "w1.json").read_text())
    for key in ("date", "git_commit", "source_digest", "gpu", "torch", "command", "rows", "summary"):
        assert key in record, key
    assert record["quick"] and record["schema"] == suite.SCHEMA and record["entry"] == "w1"
    by_name = {r["row"]: r for r in record["rows"]}
    assert list(by_name) == [r.split("/")[1] for r in rows]
    for name in ("slipstream-none", "slipstream-full", "naive-none", "naive-full"):
        r = by_name[name]
        assert r["status"] == "ok" and r["kind"] == "matrix" and tuple(r["fairness"]) == FAIRNESS_KEYS, name
    # without liger-kernel its TRL configuration is an explained row, not a silent run without it
    assert by_name["trl-liger-ckpt"]["status"] == "missing" and "liger-kernel" in by_name["trl-liger-ckpt"]["install"]
    op = by_name["logprob-op-entropy"]
    # fp32 against float64, log-probs and entropy: measured 5.7e-07, tolerance 2e-6 (3.5x)
    assert op["kind"] == "logprob_op" and op["with_entropy"] and op["max_abs_err_vs_fp64"] < 2e-6
    # every ratio pairs rows of this file at the same recompute policy, and says which
    ratios = {tuple(q["rows"]): q for q in record["summary"]["ratios"]}
    assert ratios[("slipstream-none", "naive-none")]["recompute"] == ["none", "none"]
    assert ratios[("slipstream-full", "naive-full")]["recompute"] == ["full", "full"]
    md = (tmp_path / "w1.md").read_text()
    assert "## Ratios (both rows from this file)" in md and "recompute full / full" in md
    assert "| tiny (tiny) | naive-full | ok | torch: plain PyTorch loop" in md
    plan = json.loads((tmp_path / "plan-balance.json").read_text())["rows"][0]
    assert [p["ranks"] for p in plan["plans"]] == [1, 2, 4, 8] and plan["plans"][0]["work_max_over_mean"] == 1.0

    # --resume keeps the rows measured with the same tree and machine and runs only what is missing
    first = {r["row"]: r["wall_s"] for r in record["rows"]}
    assert suite.run_suite_command(_args("--quick", "--only", "w1/naive-full", "w1/trl-ckpt", "--resume",
                                         "--out", str(tmp_path))) == 0  # fmt: skip
    again = {r["row"]: r for r in json.loads((tmp_path / "w1.json").read_text())["rows"]}
    assert again["naive-full"]["wall_s"] == first["naive-full"] and again["trl-ckpt"]["status"] == "ok"
    record["source_digest"] = "another-tree"
    (tmp_path / "w1.json").write_text(json.dumps(record))
    assert suite.run_suite_command(_args("--quick", "--only", "w1/trl-ckpt", "--resume", "--out", str(tmp_path))) == 2


def test_a_row_runs_in_a_fresh_process(monkeypatch):
    # On a GPU every row runs in its own process (a fresh CUDA context); the same path, CPU-sized.
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    entry = suite._registry()["plan-balance"]
    row = suite.run_row_in_child(entry, entry.rows(False)[1], quick=False, timeout_s=120)
    assert row["status"] == "ok" and row["row"] == "w1-8b-16k" and row["plans"][0]["micro_batches_per_rank"] == 10
    assert row["cuda_alloc_conf"] == "expandable_segments:True"  # the training entries' allocator
    # an entry that asks for torch's default allocator (the rollout's, as its command alone gets) runs without it
    plain = dataclasses.replace(entry, allocator=None)
    assert suite.run_row_in_child(plain, plain.rows(False)[1], quick=False, timeout_s=120)["cuda_alloc_conf"] is None
    assert suite._registry()["rollout"].allocator is None


def test_quick_rollout_and_rl_step_w1_run_and_say_which_loop_ran(tmp_path):
    assert suite.run_suite_command(_args("--quick", "--only", "rollout", "rl-step-w1", "--out", str(tmp_path))) == 0
    (fixed,) = json.loads((tmp_path / "rollout.json").read_text())["rows"]
    assert fixed["status"] == "ok" and {r["engine"] for r in fixed["data"]["rows"]} == {"slipstream"}
    first = next(r for r in fixed["data"]["rows"] if r["call"] == "first")
    assert f"slipstream {first['case']} first: {first['tok_per_s']:,.0f} tok/s" in (tmp_path / "rollout.md").read_text()
    record = json.loads((tmp_path / "rl-step-w1.json").read_text())
    rows = {r["row"]: r for r in record["rows"]}
    assert set(rows) == {"sync", "sync-awake", "async-staleness-1", "async-staleness-1-shared-stream",
                         "async-staleness-1-reprefill", "fixed-512-slipstream", "fixed-512-trl"}
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["sync"]["fairness"]["placement"].endswith("synchronous")  # the async row says so, with its bound
    assert rows["sync-awake"]["fairness"]["placement"].endswith("synchronous, rollout awake while training")
    assert rows["async-staleness-1"]["fairness"]["placement"].endswith("asynchronous, max_staleness 1")
    assert rows["async-staleness-1-shared-stream"]["fairness"]["placement"].endswith("on the trainer's CUDA stream")
    assert rows["async-staleness-1-reprefill"]["fairness"]["placement"].endswith("re-prefilled at a weight sync")
    # the async rows carry their staleness (at most the bound) and drops; the sync rows the rollout's log-prob
    # mismatch (measured on tokens of the trainer's current weights, which an async step may not have)
    stale = rows["async-staleness-1"]["metrics"]["async/staleness_max"]
    assert stale["max"] <= 1 and "async/dropped_stale" in rows["async-staleness-1"]["metrics"]
    assert "async/staleness_max" not in rows["sync"]["metrics"]
    assert all("rollout/logprob_abs_diff_mean" in rows[n]["metrics"] for n in ("sync", "sync-awake", "fixed-512-slipstream"))
    assert set(record["summary"]) == {"sync_over_async_step_time", "sync_over_sync_awake_step_time",
                                      "shared_over_own_stream_step_time", "reprefill_over_keep_step_time",
                                      "trl_over_slipstream_step_time"}


def test_quick_demo_reads_training_rows_beside_the_eval_rows(tmp_path):
    assert suite.run_suite_command(_args("--quick", "--only", "demo", "--out", str(tmp_path))) == 0
    (row,) = json.loads((tmp_path / "demo.json").read_text())["rows"]
    assert row["status"] == "ok" and row["steps"] == 20  # the step-0 eval row is not a step
    assert 0.0 <= row["reward_first10"] <= 1.0 and row["step_time_median_s"] > 0


def test_quick_real_model_reports_the_eval_curve_and_the_async_ratio(tmp_path):
    assert suite.run_suite_command(_args("--quick", "--only", "real-model", "--out", str(tmp_path))) == 0
    record = json.loads((tmp_path / "real-model.json").read_text())
    rows = {r["row"]: r for r in record["rows"]}
    assert set(rows) == {"demo-sync", "demo-async-staleness-1"}
    for row in rows.values():
        assert row["status"] == "ok" and row["steps"] == 4
        # the demo evaluates before training and after the last step: two points, in time order
        assert [p["step"] for p in row["eval_curve"]] == [0, 4]
        assert 0 < row["eval_curve"][0]["elapsed_s"] < row["eval_curve"][1]["elapsed_s"] <= row["wall_s"]
        (name,) = row["before"]
        assert row["gain_points"][name] == 100 * (row["after"][name] - row["before"][name])  # the same arithmetic
    assert rows["demo-async-staleness-1"]["staleness_mean"] is not None and rows["demo-sync"]["staleness_mean"] is None
    assert record["summary"]["demo_sync_over_async_step_time"] > 0
    assert all(row["held_out"] == {"sum": False} for row in rows.values())  # the demo's eval is its whole space
    text = (tmp_path / "real-model.md").read_text()
    assert "problems, not held out)" in text and "Curve: step 0 (" in text
    ratio = record["summary"]["demo_sync_over_async_step_time"]
    assert f"- `demo_sync_over_async_step_time`: {ratio:.3f}" in text  # the summary is in the page, not only the json
    figure = tmp_path / "real-model-eval.png"  # the curves as a picture
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 5000


def test_a_command_ends_by_its_rows_deadline_and_keeps_its_output(monkeypatch):
    from benchmarks.suite_entries import command_row

    monkeypatch.setenv("SLIPSTREAM_ROW_DEADLINE", str(time.time() + 2))
    start = time.monotonic()
    row = command_row(["-c", "import time; print('measured so far', flush=True); time.sleep(60)"], timeout_s=600)
    assert time.monotonic() - start < 20  # the row's deadline, not the command's own 600 s
    assert row["status"] == "error" and row["reason"].startswith("timed out after")
    assert "measured so far" in row["output_tail"]


def test_w1_summary_pairs_each_peer_recompute_policy_with_slipstream_at_that_policy():
    from benchmarks.suite_entries import w1_summary

    def row(name: str, recompute: str, tok_per_s: float) -> dict:
        return {"row": name, "kind": "matrix", "status": "ok", "fairness": {"recompute": recompute},
                "phases": {"actor_train": {"tok_per_s": tok_per_s, "peak_memory_gib": 1.0}}}  # fmt: skip

    rows = [row("slipstream-none", "none", 400.0), row("slipstream-full", "full", 300.0),
            row("trl-no-ckpt", "none", 150.0), row("trl-liger-no-ckpt", "none", 200.0),
            row("trl-ckpt", "full (HF gradient checkpointing, every layer)", 100.0),
            row("trl-liger-ckpt", "full (HF gradient checkpointing, every layer)", 120.0)]  # fmt: skip
    ratios = {tuple(q["rows"]): q["ratio"] for q in w1_summary(rows)["ratios"]}
    # the best TRL row overall (none), and the best TRL row at full recompute, each against slipstream at its policy
    assert ratios == {("slipstream-none", "trl-liger-no-ckpt"): 2.0, ("slipstream-full", "trl-liger-ckpt"): 2.5}


def test_async_gpus_splits_follow_the_measured_rollout_share_and_the_speedup_is_against_its_own_sync_row():
    from slipstream.bench.report import suite_markdown
    from benchmarks.suite_entries import W1_ROLLOUT_SHARE, async_gpus_summary, async_splits

    assert 0.78 < W1_ROLLOUT_SHARE < 0.79  # 15.50 s of generation in a 19.70 s generate + train step
    # 1:1, the suggested split (round(0.787 N) rollout GPUs, with max_staleness 4 too) and N-1 : 1, never 0 or N
    assert async_splits(2) == {1: (1, 4)}
    assert async_splits(4) == {2: (1,), 3: (1, 4)}
    assert async_splits(8) == {4: (1,), 6: (1, 4), 7: (1,)}

    def rl_run(name: str, per_hour: float) -> dict:
        return {"row": name, "status": "ok", "kind": "rl_run", "steps_timed": 4, "samples_per_hour": per_hour,
                "step_time_median_s": 3600 * 64 / per_hour, "trainer_wait_ratio": 0.1, "rollout_wait_ratio": 0.2,
                "staleness_mean": 1.0, "staleness_max": 1, "weight_sync_s": 0.05}  # fmt: skip

    rows = [rl_run("sync-colocated-x8", 1000.0), rl_run("async-disaggregated-6to2-staleness-1", 2500.0),
            rl_run("rg-sync-colocated-x8", 400.0), {**rl_run("rg-async-disaggregated-4to4-staleness-1", 600.0),
                                                    "gain_points": {"chain_sum": 30.0}}]  # fmt: skip
    summary = async_gpus_summary(rows)
    # each async row over the sync row of its own recipe, never across recipes
    assert summary == {"async-disaggregated-6to2-staleness-1_over_sync_samples_per_hour": 2.5,
                       "rg-async-disaggregated-4to4-staleness-1_over_sync_samples_per_hour": 1.5,
                       "rg-async-disaggregated-4to4-staleness-1_gain_points": {"chain_sum": 30.0}}  # fmt: skip
    record = {"entry": "async-gpus", "description": "d", "date": "2026-12-04", "git_commit": "c", "source_digest": "s",
              "gpu": "H200", "num_gpus": 8, "torch": "2.11", "cuda": "13.0", "transformers": "5.17", "python": "3.12",
              "cpu_count": 16, "load_avg_1m": 0.5, "command": "slipstream bench suite", "quick": False,
              "rows": rows[:2], "summary": async_gpus_summary(rows[:2])}  # fmt: skip
    text = suite_markdown(record)
    assert "- `async-disaggregated-6to2-staleness-1` 4 timed steps: step time median 92.160 s, 2,500 samples/h" in text
    assert "- `async-disaggregated-6to2-staleness-1_over_sync_samples_per_hour`: 2.500" in text
