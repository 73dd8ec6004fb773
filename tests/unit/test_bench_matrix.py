"""CPU tests of `slipstream bench matrix`: spec validation, row schema, peers, statistics, report, tiny run."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from slipstream.bench import matrix
from slipstream.bench import rows as matrix_rows
from slipstream.bench.cli import add_bench_parser, run_matrix_command
from slipstream.bench.matrix import make_row, run_matrix
from slipstream.bench.rows import FAIRNESS_KEYS, ROW_KEYS, read_rows
from slipstream.bench.settings import CellSettings
from slipstream.bench.spec import load_spec, parse_spec
from benchmarks.peers import install_command, peer_version
from slipstream.bench.report import markdown_table, write_matrix_report
from slipstream.bench.train_step import phase_stats
from slipstream.bench.workloads import WORKLOADS, get_workload, synthetic_batch

REPO = Path(__file__).resolve().parents[2]
HAS_TRL = peer_version("trl") is not None


pytestmark = pytest.mark.usefixtures("one_thread")


def _spec(**overrides) -> dict:
    base = {"workloads": ["tiny"], "frameworks": ["slipstream"], "backends": ["fsdp"], "device": "cpu"}
    return {**base, **overrides}


# ---------------------------------------------------------------- spec validation


def test_spec_parses_named_inline_and_like_workloads():
    spec = parse_spec(_spec(
        workloads=[
            "tiny",
            {"like": "W1", "name": "W1-small", "preset": "qwen3-0.6b"},
            {"name": "mine", "preset": "tiny", "num_prompts": 2, "group_size": 2, "prompt_len": 8,
             "response_len": [4, 16], "response_dist": "uniform", "seed": 3},
        ],
        frameworks=["slipstream", "trl"], backends=["fsdp", "megatron"], recompute="full", repeats=2,
        peers={"trl": {"per_device_train_batch_size": 2}},
    ))  # fmt: skip
    tiny, small, mine = spec.workloads
    assert tiny == WORKLOADS["tiny"]
    # `like` keeps every length field of W1 and changes only what is given.
    assert (small.name, small.preset, small.response_len, small.seed) == ("W1-small", "qwen3-0.6b", (256, 3584), 1234)
    assert (mine.prompt_len, mine.response_len, mine.response_dist) == ((8, 8), (4, 16), "uniform")
    assert spec.settings == CellSettings(recompute="full", repeats=2, device="cpu")
    assert spec.trl.per_device_train_batch_size == 2 and spec.trl.loss_type == "dapo"
    # slipstream on each backend; TRL has one engine (accelerate), so one row per workload
    assert len(spec.cells()) == 3 * (2 + 1)
    assert spec.cells()[:3] == [(tiny, "slipstream", "fsdp"), (tiny, "slipstream", "megatron"), (tiny, "trl", "accelerate")]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"framworks": ["trl"]}, r"unknown key 'framworks'; did you mean 'frameworks'"),
        ({"workloads": [{"like": "tiny", "name": "t2", "respone_len": [1, 2]}]}, r"workloads\[0\]\.'respone_len'; did you mean 'response_len'"),
        ({"peers": {"trl": {"loss": "dapo"}}}, r"peers\.trl\.'loss'; did you mean 'loss_type'"),
        ({"peers": {"trll": {}}}, r"peers\.'trll'; did you mean 'trl'"),
        ({"dtype": "fp16"}, r"dtype must be one of"),
        ({"recompute": "selectiv"}, r"recompute .*did you mean 'selective'"),
        ({"repeats": 0}, r"repeats must be an integer >= 1"),
        ({"repeats": True}, r"repeats must be an integer"),
        ({"warmup": -1}, r"warmup must be an integer >= 0"),
        ({"compile": "yes"}, r"compile must be true or false"),
        ({"peak_flops": -1}, r"peak_flops must be a positive"),
        ({"frameworks": []}, r"frameworks must be a non-empty list"),
        ({"backends": []}, r"backends must be a non-empty list"),
        ({"workloads": []}, r"workloads must be a non-empty list"),
        ({"frameworks": ["slipstream", "deepspeed"]}, r"frameworks\[1\] must be one of"),
        ({"backends": ["fsdp", "fsdp"]}, r"backends lists a value twice"),
        ({"mode": "rl_step"}, r"mode must be one of \('train-step', 'rl-step'\).*did you mean 'rl-step'"),
        ({"workloads": ["W9"]}, r"workloads\[0\]: unknown workload 'W9'"),
        ({"workloads": [{"like": "tiny", "name": "x", "preset": "qwen3-1.7"}]}, r"workloads\[0\]: unknown model preset.*did you mean"),
        ({"workloads": [{"name": "x", "preset": "tiny"}]}, r"workloads\[0\] is missing num_prompts, group_size, prompt_len, response_len"),
        ({"workloads": [{"like": "tiny", "name": "x", "prompt_len": [5, 3]}]}, r"workloads\[0\]: prompt_len must be"),
        ({"workloads": [{"like": "tiny", "num_prompts": 4}]}, r"workloads\[0\] changes workload 'tiny': give it a new `name`"),
        ({"workloads": ["tiny", "tiny"]}, r"distinct names"),
        ({"peers": {"trl": {"per_device_train_batch_size": 3}}}, r"does not divide the 8 sequences of workload 'tiny'"),
        ({"on_error": "ignore"}, r"on_error must be one of"),
        ({"master_dtype": "bf16"}, r"master_dtype must be one of.*did you mean 'bfloat16'"),
        ({"master_dtype": "bfloat16", "dtype": "float32"}, r"master_dtype: bfloat16 needs dtype: bfloat16"),
    ],
)
def test_spec_rejects_bad_input_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(_spec(**overrides))


def test_spec_requires_the_three_lists_and_a_mapping(tmp_path):
    for key in ("workloads", "frameworks", "backends"):
        data = _spec()
        del data[key]
        with pytest.raises(ValueError, match=f"missing required key '{key}'"):
            parse_spec(data)
    with pytest.raises(ValueError, match="top level must be a mapping"):
        parse_spec(["tiny"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("workloads: [tiny\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_spec(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")


def test_w1_spec_file():
    spec = load_spec(REPO / "benchmarks" / "specs" / "matrix_w1.yaml")
    assert [(w.name, w.preset) for w in spec.workloads] == [("W1", "qwen3-1.7b"), ("W1-0.6b", "qwen3-0.6b")]
    # The inline W1-0.6b has exactly the lengths of the named one.
    assert spec.workloads[1] == WORKLOADS["W1-0.6b"]
    assert spec.frameworks == ("slipstream", "trl", "verl") and spec.backends == ("fsdp", "megatron")
    assert (spec.settings.mode, spec.settings.dtype, spec.settings.recompute) == ("train-step", "bfloat16", "full")
    assert len(spec.cells()) == 2 * (2 + 1 + 2)  # TRL: one accelerate row per workload


# ---------------------------------------------------------------- rows, statistics, peers


def test_rows_without_numbers_have_the_full_schema(tmp_path, monkeypatch):
    # No cell here runs a model: verl's megatron column is an explained row, without a site verl is missing.
    spec = parse_spec(_spec(frameworks=["verl"], backends=["megatron", "fsdp"], recompute="selective"))
    monkeypatch.delenv("SLIPSTREAM_VERL_SITE", raising=False)
    out = tmp_path / "r.jsonl"
    rows = run_matrix(spec, out)
    assert read_rows(out) == json.loads(json.dumps(rows))
    assert [r["status"] for r in rows] == ["not-available", "missing"]
    for r in rows:
        assert tuple(r) == ROW_KEYS and r["schema"] == matrix_rows.SCHEMA
        assert r["reason"] and r["phases"] == {} and r["metrics"] == {}
        # Everything not varied is in every row.
        assert r["held_constant"]["recompute"] == "selective" and r["held_constant"]["device"] == "cpu"
        assert r["held_constant"] == rows[0]["held_constant"]
        assert r["workload"]["num_tokens"] == sum(p + q for p, q in matrix_lengths("tiny"))
        assert r["env"]["torch"] == torch.__version__ and "peers" in r["env"]
    verl = rows[0]
    assert "Transformer Engine" in verl["reason"] and verl["install"] is None
    assert verl["impl"]["config"]["engine"] == "megatron"


def matrix_lengths(name: str) -> list[tuple[int, int]]:
    from slipstream.bench.workloads import make_lengths

    return make_lengths(get_workload(name))


def test_missing_trl_row_says_how_to_install(monkeypatch):
    from benchmarks.peers import trl_adapter

    monkeypatch.setattr(trl_adapter, "peer_version", lambda name: None)
    spec = parse_spec(_spec(frameworks=["trl"]))
    (row,) = run_matrix(spec)
    assert row["status"] == "missing" and "trl is not installed" in row["reason"]
    assert row["install"] == f"pip install trl==1.16.0 'torch=={torch.__version__.split('+')[0]}'"
    assert row["install"] == install_command("trl")
    with pytest.raises(ValueError, match="unknown peer"):
        peer_version("deepspeed")


def test_failing_cell_is_recorded_or_raised(monkeypatch):
    def boom(*args):
        raise RuntimeError("adapter exploded")

    monkeypatch.setattr(matrix, "run_cell", boom)
    (row,) = run_matrix(parse_spec(_spec()))
    assert row["status"] == "error" and row["reason"].startswith("RuntimeError: adapter exploded")
    with pytest.raises(RuntimeError, match="exploded"):
        run_matrix(parse_spec(_spec(on_error="raise")))

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(matrix, "run_cell", oom)
    assert run_matrix(parse_spec(_spec()))[0]["status"] == "oom"


def test_resume_keeps_finished_cells_and_reruns_the_rest(tmp_path, monkeypatch):
    calls, failing = [], {"verl"}

    def fake_cell(spec, w, framework, backend):
        calls.append(f"{w.name}/{framework}/{backend}")
        if framework in failing:
            raise RuntimeError("first sitting failed here")
        return {"status": "not-applicable", "reason": f"run #{len(calls)}"}

    monkeypatch.setattr(matrix, "run_cell", fake_cell)
    spec = parse_spec(_spec(frameworks=["slipstream", "trl", "verl"], backends=["fsdp", "megatron"]))
    out = tmp_path / "results.jsonl"
    first = run_matrix(spec, out)
    assert [r["status"] for r in first][-2:] == ["error", "error"] and len(calls) == 5
    # the sitting stopped after four cells: drop the last row from the file
    out.write_text("".join(line + "\n" for line in out.read_text().splitlines()[:4]))
    calls.clear()
    failing.clear()
    second = run_matrix(spec, out, resume=True)
    # kept: the three slipstream / trl rows; run again: the two verl cells (one "error" row, one absent)
    assert calls == ["tiny/verl/fsdp", "tiny/verl/megatron"]
    assert second[:3] == json.loads(json.dumps(first[:3])) and [r["reason"] for r in second[3:]] == ["run #1", "run #2"]
    assert [r["cell"] for r in read_rows(out)] == [r["cell"] for r in second]  # spec order in the file
    # rows of another spec are refused, not mixed into the table
    other = parse_spec(_spec(frameworks=["slipstream", "trl", "verl"], backends=["fsdp", "megatron"], repeats=7))
    with pytest.raises(ValueError, match="different held-constant settings"):
        run_matrix(other, out, resume=True)
    # ... and so are rows from another machine; a "missing" peer (installed since) runs again
    rows = read_rows(out)
    rows[0]["env"]["torch"] = "0.0-elsewhere"
    rows[1]["status"] = "missing"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="tiny/slipstream/fsdp .* was run with torch '0.0-elsewhere'"):
        run_matrix(spec, out, resume=True)
    rows[0]["env"]["torch"] = torch.__version__
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls.clear()
    run_matrix(spec, out, resume=True)
    assert calls == ["tiny/slipstream/megatron"]
    # rows recorded before a setting existed count at its default: kept, unless the spec changes it
    rows = read_rows(out)
    for r in rows:
        del r["held_constant"]["master_dtype"]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls.clear()
    run_matrix(spec, out, resume=True)
    assert calls == []
    bf16 = parse_spec(_spec(frameworks=["slipstream", "trl", "verl"], backends=["fsdp", "megatron"],
                            dtype="bfloat16", master_dtype="bfloat16"))  # fmt: skip
    with pytest.raises(ValueError, match="different held-constant settings"):
        run_matrix(bf16, out, resume=True)


def test_noise_and_stats_by_hand():
    p = phase_stats([2.0, 1.0, 4.0], flops=6e12, tokens=300, peak_bytes=3 * 2**30, peak_flops=1e12)
    (noisy,) = matrix_rows.add_noise({"actor_train": p}).values()
    assert (noisy["time_s"], noisy["time_min_s"], noisy["time_max_s"]) == (2.0, 1.0, 4.0)
    # exact arithmetic on given times: measured 0 (default rel 1e-6)
    assert noisy["rel_spread"] == pytest.approx((4.0 - 1.0) / 2.0)
    # exact arithmetic on given times: measured 0 (default rel 1e-6)
    assert noisy["tok_per_s"] == pytest.approx(150.0) and noisy["tflops"] == pytest.approx(3.0)
    # exact arithmetic on given times: measured 0 (default rel 1e-6)
    assert noisy["mfu"] == pytest.approx(3.0) and noisy["peak_memory_gib"] == pytest.approx(3.0)


# ---------------------------------------------------------------- report


def _synthetic_rows(spec) -> list[dict]:
    """Rows with made-up times (report rendering only), built through the real row constructor."""
    w = spec.workloads[0]
    env = {"gpu": "NVIDIA H200", "num_gpus": 1, "torch": "2.11.0", "transformers": "5.17.0", "cuda": "13.0",
           "python": "3.12", "git_commit": "abc1234", "time": "2026-12-02", "command": "slipstream bench matrix x.yaml",
           "peers": {"trl": "1.16.0", "verl": None, "accelerate": "1.16.0"}}  # fmt: skip
    fairness = dict.fromkeys(FAIRNESS_KEYS, "x") | {"padding_fraction": 0.25}

    def ok(times, peak_gib):
        return {
            "status": "ok", "fairness": fairness,
            "phases": {
                "actor_train": phase_stats(times, 989e12 * 2.0, 100_000, int(peak_gib * 2**30), 989e12),
                "log_probs": phase_stats([t / 3 for t in times], 989e12 * 2.0 / 3, 100_000, int(2**30), 989e12),
            },
        }  # fmt: skip

    results = {
        ("slipstream", "fsdp"): ok([1.0, 0.9, 1.1], 40.0),
        ("slipstream", "megatron"): {"status": "not-available", "reason": "no megatron step yet"},
        ("trl", "accelerate"): ok([2.0, 2.0, 2.2], 50.0),
        ("verl", "fsdp"): {"status": "missing", "reason": "verl is not installed", "install": "pip install verl"},
    }
    return [make_row(spec, w, f, b, r, env) for (f, b), r in results.items()]


def test_report_renders_table_and_pngs(tmp_path):
    spec = parse_spec(_spec(frameworks=["slipstream", "trl", "verl"], backends=["fsdp", "megatron"]))
    rows = _synthetic_rows(spec)
    jsonl = tmp_path / "results.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = write_matrix_report(jsonl, tmp_path / "report")
    for name in ("phases", "mfu", "memory"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[name].stat().st_size > 5000
    md = paths["markdown"].read_text()
    assert md == markdown_table(rows)
    lines = md.splitlines()
    slip = next(line for line in lines if line.startswith("| tiny (tiny) | slipstream | ok | fsdp: x (x proc.) |"))
    # median 1.0 s for 100k tokens and 2 s of peak FLOPs: 100,000 tok/s, 1978 TFLOP/s, 200% MFU (made-up),
    # noise (1.1 - 0.9) / 1.0 = 20%, twice TRL's 50,000 tok/s.
    for cell in ("1.000 (0.900-1.100)", "20.0%", "100,000", "2.00x", "1978.0", "200.0%", "40.0", "0.333", "25.0%"):
        assert cell in slip, cell
    trl = next(line for line in lines if line.startswith("| tiny (tiny) | trl | ok | accelerate: x (x proc.) |"))
    assert "50,000" in trl and "1.00x" in trl
    # no setting is claimed for all rows in the header: each row states its own
    assert "Held constant" not in md and "compile True" not in md
    assert "- `tiny/verl/fsdp` **missing**: verl is not installed Install: `pip install verl`" in md
    assert "- `tiny/slipstream/megatron` **not-available**: no megatron step yet" in md
    assert "| cell | " + " | ".join(FAIRNESS_KEYS) + " |" in md
    assert "NVIDIA H200" in md and "`abc1234`" in md and "Best TRL row per workload: tiny: `tiny/trl/accelerate`" in md
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no result rows"):
        write_matrix_report(empty, tmp_path / "r2")


def test_cli_parses_matrix_and_redraws_report(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "matrix", "benchmarks/specs/matrix_w1.yaml", "--out", str(tmp_path), "--report-only"])
    assert args.func is run_matrix_command and args.spec == Path("benchmarks/specs/matrix_w1.yaml") and args.report_only
    spec = parse_spec(_spec(frameworks=["slipstream", "trl", "verl"], backends=["fsdp", "megatron"]))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _synthetic_rows(spec)))
    assert run_matrix_command(args) == 0
    assert "| tiny (tiny) | trl | ok | accelerate: x (x proc.) |" in capsys.readouterr().out
    assert (tmp_path / "mfu.png").exists()


# ---------------------------------------------------------------- TRL adapter and a tiny end-to-end matrix


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
def test_trl_inputs_pad_like_trl():
    from benchmarks.peers.trl_adapter import trl_inputs

    w = get_workload("tiny")
    batch = synthetic_batch(w, 96)
    lengths = matrix_lengths("tiny")
    d = trl_inputs(batch, pad_token_id=0)
    max_p, max_r = max(p for p, _ in lengths), max(r for _, r in lengths)
    assert d["prompt_ids"].shape == (8, max_p) and d["completion_ids"].shape == (8, max_r)
    cu = batch.cu_seqlens.tolist()
    for i, (p, r) in enumerate(lengths):
        seq = batch.input_ids[cu[i] : cu[i + 1]]
        # prompts left-padded, completions right-padded
        assert d["prompt_mask"][i].tolist() == [0] * (max_p - p) + [1] * p
        assert torch.equal(d["prompt_ids"][i, max_p - p :], seq[:p])
        assert d["completion_mask"][i].tolist() == [1] * r + [0] * (max_r - r)
        assert torch.equal(d["completion_ids"][i, :r], seq[p:])
        # old log-probs of completion token j sit at packed position p - 1 + j
        assert torch.equal(d["old_per_token_logps"][i, :r], batch.old_logprobs[cu[i] + p - 1 : cu[i] + p - 1 + r])
        assert float(d["advantages"][i]) == float(batch.advantages[cu[i] + p - 1])
    assert int(d["num_items_in_batch"]) == int(batch.loss_mask.sum())


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_trl_loss_matches_slipstream(loss_type):
    # TRL's compute_loss summed over its micro-batches vs slipstream's aggregation of the same
    # name (dapo = token-mean, grpo = seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm),
    # fp32, same weights and batch: two independent implementations must agree.
    from benchmarks.peers.trl_adapter import trl_loss_cross_check

    out = trl_loss_cross_check("tiny", per_device_train_batch_size=4, loss_type=loss_type)
    assert out["num_micro_batches"] == 2
    assert math.isfinite(out["trl"]) and abs(out["trl"]) > 1e-3
    # fp32, two implementations: measured max |diff| 5.2e-08 (rel 1.2e-06): 4x margin
    assert out["trl"] == pytest.approx(out["slipstream"], rel=5e-6, abs=2e-7)


def test_tiny_matrix_end_to_end(tmp_path):
    spec = parse_spec(_spec(
        frameworks=["slipstream", "naive", "trl"], backends=["fsdp", "megatron"], dtype="float32", repeats=2,
        warmup=0, recompute="full", peers={"trl": {"per_device_train_batch_size": 4}, "naive": {"micro_batch_size": 3}},
    ))  # fmt: skip
    rows = run_matrix(spec, tmp_path / "results.jsonl")
    slip, mega, naive, trl = rows
    assert trl["backend"] == "accelerate"  # TRL's one engine, in one process: never labelled fsdp
    # the naive HF loop is a row like the others, with its own settings in it
    assert naive["status"] == "ok" and naive["backend"] == "torch" and tuple(naive["fairness"]) == FAIRNESS_KEYS
    assert naive["micro_batches"]["count"] == 3 and naive["fairness"]["recompute"].startswith("full")
    assert naive["phases"]["actor_train"]["tokens"] == slip["phases"]["actor_train"]["tokens"]
    # the megatron column runs slipstream's megatron-core engine on the same batch and budget
    assert mega["status"] == "ok" and mega["impl"]["config"]["backend"] == "megatron", mega["reason"]
    assert mega["micro_batches"] == slip["micro_batches"] and tuple(mega["fairness"]) == FAIRNESS_KEYS
    assert mega["phases"]["actor_train"]["tokens"] == slip["phases"]["actor_train"]["tokens"]
    assert mega["fairness"]["recompute"] == "megatron recompute_granularity full"
    real = sum(p + r for p, r in matrix_lengths("tiny"))
    assert slip["status"] == "ok" and slip["impl"]["config"]["backend"] == "fsdp"
    assert tuple(slip["fairness"]) == FAIRNESS_KEYS
    assert slip["fairness"]["padded_tokens"] == slip["fairness"]["real_tokens"] == real
    train = slip["phases"]["actor_train"]
    assert len(train["times_s"]) == 2 and train["tokens"] == real and train["tok_per_s"] > 0
    assert 0 <= train["rel_spread"] and slip["metrics"]["perf/actor_train_time"] == train["time_s"]
    if not HAS_TRL:
        assert trl["status"] == "missing" and trl["install"]
        pytest.skip("trl is not installed: its cell was checked to be a 'missing' row, its numbers are not checked")
    assert trl["status"] == "ok", trl["reason"]
    assert tuple(trl["fairness"]) == FAIRNESS_KEYS
    assert trl["impl"]["version"] == peer_version("trl") and trl["impl"]["config"]["gradient_checkpointing"]
    assert trl["phases"]["actor_train"]["tokens"] == real and len(trl["phases"]["log_probs"]["times_s"]) == 2
    # TRL pads all 8 rows to the batch's longest prompt + longest completion.
    lengths = matrix_lengths("tiny")
    assert trl["fairness"]["padded_tokens"] == 8 * (max(p for p, _ in lengths) + max(r for _, r in lengths))
    assert trl["micro_batches"]["count"] == 2 and math.isfinite(trl["impl"]["last_loss"])
    paths = write_matrix_report(tmp_path / "results.jsonl", tmp_path)
    assert "| tiny (tiny) | trl | ok | accelerate: transformers Trainer on accelerate (no FSDP) (1 proc.) |" in (
        paths["markdown"].read_text()
    )
    assert trl["fairness"]["compile"] == "no" and slip["fairness"]["processes"] == 1


def test_bf16_master_cell_runs_and_says_so(tmp_path):
    """master_dtype: bfloat16 reaches slipstream's fsdp engine; the megatron cell keeps fp32 master weights."""
    spec = parse_spec(_spec(backends=["fsdp", "megatron"], dtype="bfloat16", master_dtype="bfloat16", repeats=1, warmup=0))
    fsdp, mega = run_matrix(spec, tmp_path / "results.jsonl")
    assert fsdp["status"] == "ok" and mega["status"] == "ok", (fsdp["reason"], mega["reason"])
    assert fsdp["impl"]["config"]["master_dtype"] == "bfloat16" and mega["impl"]["config"]["master_dtype"] == "float32"
    assert "bf16 state (stochastic rounding)" in fsdp["fairness"]["optimizer"]
    assert "fp32 state" in mega["fairness"]["optimizer"]
    assert fsdp["held_constant"]["master_dtype"] == "bfloat16"
    report = write_matrix_report(tmp_path / "results.jsonl", tmp_path)["markdown"].read_text()
    assert "| tiny (tiny) | slipstream | ok | fsdp: FSDP2 (fully_shard per block) (1 proc.) | bfloat16 / bf16 parameters, " \
        "gradients and AdamW state, stochastically rounded updates | no |" in report


def test_trl_options_parse_and_liger_needs_its_package(monkeypatch):
    from benchmarks.peers import trl_adapter

    spec = parse_spec(_spec(frameworks=["trl"], peers={"trl": {"use_liger_kernel": True, "params_dtype": "float32"}}))
    assert spec.trl.use_liger_kernel and spec.trl.params_dtype == "float32"
    with pytest.raises(ValueError, match="params_dtype must be one of"):
        parse_spec(_spec(frameworks=["trl"], peers={"trl": {"params_dtype": "fp8"}}))
    # without liger-kernel the Liger configuration is an explained row, not a silent run without it
    monkeypatch.setattr(trl_adapter, "peer_version", lambda name: None if name == "liger-kernel" else "1.16.0")
    row = trl_adapter.run_trl_cell(spec.workloads[0], spec.settings, spec.trl)
    assert row["status"] == "missing" and "liger-kernel==0.8.5" in row["install"]
