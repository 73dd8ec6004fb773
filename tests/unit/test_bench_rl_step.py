"""CPU tests of `slipstream bench matrix` in mode rl-step: spec validation, statistics, a tiny run, the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from slipstream.bench.matrix import make_row, run_matrix
from slipstream.bench.rows import ROW_KEYS, read_rows
from slipstream.bench.spec import load_spec, parse_spec
from slipstream.bench.report import markdown_table, write_matrix_report
from slipstream.bench.rl_step import CORE_METRICS, step_statistics
from slipstream.bench.settings import RLStepSettings

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes" / "demo.yaml")


pytestmark = pytest.mark.usefixtures("one_thread")


def _spec(rl_step: dict | None = None, **top) -> dict:
    base = {"mode": "rl-step", "frameworks": ["slipstream"], "backends": ["local"], "device": "cpu",
            "rl_step": {"recipe": DEMO, "steps": 3, "warmup_steps": 1} if rl_step is None else rl_step}  # fmt: skip
    return {**base, **top}


# ---------------------------------------------------------------- spec validation


def test_rl_step_spec_parses():
    spec = parse_spec(_spec(
        {"recipe": DEMO, "steps": 5, "warmup_steps": 2, "overrides": ["rollout.max_new_tokens=2"]},
        frameworks=["slipstream", "trl"], backends=["local", "fsdp", "megatron"], peak_flops=1e12,
    ))  # fmt: skip
    rl = spec.rl_step
    assert rl == RLStepSettings(recipe=DEMO, steps=5, warmup_steps=2, overrides=("rollout.max_new_tokens=2",), name="demo")
    assert spec.settings.mode == "rl-step" and spec.settings.peak_flops == 1e12 and spec.settings.device == "cpu"
    assert spec.backends == ("local", "fsdp", "megatron")
    assert spec.cells()[:2] == [(rl, "slipstream", "local"), (rl, "slipstream", "fsdp")]
    assert spec.cells()[3:] == [(rl, "trl", "accelerate")]  # TRL's one engine, one row
    # warmup_steps defaults to 1, overrides to none, the name to the recipe's stem
    d = parse_spec(_spec({"recipe": DEMO, "steps": 2, "name": "mine"})).rl_step
    assert (d.warmup_steps, d.overrides, d.name) == (1, (), "mine")


def test_tiny_rl_step_spec_file(monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe path in the file is relative to the repository root
    spec = load_spec(REPO / "benchmarks" / "specs" / "matrix_rl_step_tiny.yaml")
    assert spec.rl_step == RLStepSettings(recipe="recipes/demo.yaml", steps=6, warmup_steps=1, name="demo",
                                      overrides=("reward.num_workers=0",))
    assert spec.frameworks == ("slipstream", "trl", "verl") and spec.backends == ("local", "fsdp", "megatron")


@pytest.mark.parametrize(
    "data, message",
    [
        (_spec(rl_step={}) | {"rl_step": None}, r"rl_step must be a mapping"),
        ({k: v for k, v in _spec().items() if k != "rl_step"}, r"missing required key 'rl_step'"),
        ({k: v for k, v in _spec().items() if k != "backends"}, r"missing required key 'backends'"),
        (_spec({"recipe": DEMO}), r"rl_step is missing required key 'steps'"),
        (_spec({"steps": 3}), r"rl_step is missing required key 'recipe'"),
        (_spec({"recipe": DEMO, "stesp": 3}), r"unknown key rl_step\.'stesp'; did you mean 'steps'"),
        (_spec({"recipe": DEMO, "steps": 3, "warmup": 1}), r"rl_step\.'warmup'; did you mean 'warmup_steps'"),
        (_spec(framworks=["trl"]), r"unknown key 'framworks'; did you mean 'frameworks'"),
        (_spec(dtype="float32"), r"key 'dtype' applies to mode train-step only"),
        (_spec(workloads=["tiny"]), r"key 'workloads' applies to mode train-step only"),
        (_spec(peers={"trl": {}}), r"key 'peers' applies to mode train-step only"),
        (_spec(mode="train-step", workloads=["tiny"]), r"key 'rl_step' applies to mode rl-step only"),
        (_spec(mode="rl_step"), r"mode must be one of .*did you mean 'rl-step'"),
        (_spec({"recipe": DEMO, "steps": 0}), r"rl_step\.steps must be an integer >= 1"),
        (_spec({"recipe": DEMO, "steps": 2, "warmup_steps": 2}), r"steps=2 leaves no timed step"),
        (_spec({"recipe": DEMO, "steps": 2, "warmup_steps": True}), r"rl_step\.warmup_steps must be an integer"),
        (_spec({"recipe": 3, "steps": 2}), r"rl_step\.recipe must be a path"),
        (_spec({"recipe": "nope/missing.yaml", "steps": 2}), r"rl_step: recipe 'nope/missing.yaml' does not exist"),
        (_spec({"recipe": DEMO, "steps": 2, "overrides": [1]}), r"overrides must be a list of 'key=value'"),
        (_spec({"recipe": DEMO, "steps": 2, "overrides": ["actor.lr"]}), r"overrides\[0\]: override 'actor.lr' must look like"),
        (_spec({"recipe": DEMO, "steps": 2, "overrides": ["actor.lrr=1"]}), r"unknown config key 'actor.lrr'; did you mean 'actor.lr'"),
        (_spec({"recipe": DEMO, "steps": 2, "overrides": ["rollout.group_size=0"]}), r"rollout.group_size must be >= 1"),
        (_spec({"recipe": DEMO, "steps": 2, "overrides": ["x=1", "actor.backend=fsdp"]}), r"overrides\[1\] sets 'actor.backend'"),
        (_spec({"recipe": DEMO, "steps": 2, "overrides": ["trainer.run_dir=x"]}), r"sets 'trainer.run_dir'"),
        (_spec({"recipe": DEMO, "steps": 2, "overrides": ["trainer.device=cpu"]}), r"sets 'trainer.device'"),
        (_spec({"recipe": DEMO, "steps": 2, "name": ""}), r"rl_step\.name must be a non-empty string"),
        (_spec(backends=["fsdp", "ddp"]), r"backends\[1\] must be one of \('local', 'fsdp', 'megatron'\)"),
        (_spec(device="tpu"), r"device must be one of"),
    ],
)
def test_rl_step_spec_rejects_bad_input_naming_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(data)


# ---------------------------------------------------------------- statistics


def test_step_statistics_by_hand():
    def step(t, rollout, train, reward, mem=None):
        m = {"perf/step_time": t, "perf/rollout_time": rollout, "perf/actor_train_time": train,
             "perf/actor_train_tflops": 2 * train, "perf/actor_train_tok_per_s": 100.0 / train, "reward/mean": reward,
             "loss/policy": 0.5}  # fmt: skip
        if mem is not None:
            m["perf/max_memory_allocated_gb/actor_train"] = mem
        return m

    # the warm-up step (10 s, no memory reading) must not enter any statistic
    per_step = [step(10.0, 9.0, 1.0, 0.0), step(2.0, 1.0, 0.5, 0.25, 3.0), step(4.0, 2.0, 1.5, 0.5, 5.0),
                step(3.0, 1.5, 1.0, 0.75, 4.0)]  # fmt: skip
    metrics, phases = step_statistics(per_step, warmup_steps=1)
    assert metrics["perf/step_time"] == {"median": 3.0, "min": 2.0, "max": 4.0, "values": [2.0, 4.0, 3.0]}
    assert metrics["perf/actor_train_tflops"]["median"] == 2.0
    assert metrics["perf/max_memory_allocated_gb/actor_train"]["max"] == 5.0
    assert "loss/policy" not in metrics  # only perf/ metrics and the reward are summarised
    r = metrics["reward/mean"]
    assert (r["first"], r["last"], r["median"], r["all_steps"]) == (0.0, 0.75, 0.5, [0.0, 0.25, 0.5, 0.75])
    assert set(phases) == {"rollout", "actor_train", "step"}
    t = phases["actor_train"]
    assert (t["time_s"], t["time_min_s"], t["time_max_s"], t["peak_memory_gib"]) == (1.0, 0.5, 1.5, 4.0)
    # exact arithmetic: measured 0 (default rel 1e-6)
    assert t["rel_spread"] == pytest.approx((1.5 - 0.5) / 1.0) and t["tflops"] == 2.0 and t["mfu"] is None
    assert phases["rollout"]["peak_memory_gib"] is None
    # a metric missing from one timed step is left out rather than summarised over fewer steps
    metrics, _ = step_statistics(per_step[1:] + [step(1.0, 0.5, 0.5, 1.0)], warmup_steps=0)
    assert "perf/max_memory_allocated_gb/actor_train" not in metrics
    with pytest.raises(ValueError, match="leave none to time"):
        step_statistics(per_step, warmup_steps=4)


# ---------------------------------------------------------------- a tiny matrix, end to end


def test_tiny_rl_step_matrix_end_to_end(tmp_path):
    overrides = ["reward.num_workers=0", "rollout.prompts_per_step=4", "rollout.max_new_tokens=2"]
    spec = parse_spec(_spec(
        {"recipe": DEMO, "steps": 3, "warmup_steps": 1, "overrides": overrides},
        frameworks=["slipstream", "trl", "verl"], backends=["local", "fsdp", "megatron"], peak_flops=1e12,
    ))  # fmt: skip
    out = tmp_path / "results.jsonl"
    rows = run_matrix(spec, out)
    assert read_rows(out) == json.loads(json.dumps(rows))
    by_cell = {r["cell"]: r for r in rows}
    # TRL has one engine: one row, labelled with what runs (accelerate), not once per slipstream backend
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "ok", "not-available", "not-available", "not-available"]
    assert [r["cell"] for r in rows if r["framework"] == "trl"] == ["demo/trl/accelerate"]
    assert "rl-step adapter for verl not written yet" in by_cell["demo/verl/local"]["reason"]
    for r in rows:
        assert tuple(r) == ROW_KEYS and r["mode"] == "rl-step"
        held = r["held_constant"]
        assert held == rows[0]["held_constant"]
        assert (held["recipe"], held["overrides"], held["steps"], held["warmup_steps"]) == (DEMO, overrides, 3, 1)
        assert held["config"]["model"]["preset"] == "tiny" and held["config"]["rollout"]["prompts_per_step"] == 4
        assert held["config"]["reward"]["num_workers"] == 0 and "backend" not in held["config"]["actor"]
        assert r["workload"] == {"name": "demo", "recipe": DEMO, "preset": "tiny", "data_source": "task:sum-mod10",
                                 "prompts_per_step": 4, "group_size": 8, "num_seqs": 32, "max_new_tokens": 2}
        if r["status"] != "ok":
            assert r["phases"] == {} and r["metrics"] == {} and r["reason"]
    local, fsdp, mega = (by_cell[f"demo/slipstream/{b}"] for b in ("local", "fsdp", "megatron"))
    trl_local = by_cell["demo/trl/accelerate"]
    # TRL's own GRPOTrainer on the same recipe: one optimizer step per 32 completions, dapo == token-mean
    assert trl_local["impl"]["name"] == "trl" and trl_local["impl"]["grpo_config"]["loss_type"] == "dapo"
    assert trl_local["impl"]["grpo_config"]["per_device_train_batch_size"] == 32
    assert trl_local["fairness"]["rollout"].startswith("TRL default generation")
    for r in (local, fsdp, mega, trl_local):
        m = r["metrics"]
        for key in CORE_METRICS:
            assert len(m[key]["values"]) == 2, key  # 3 steps, 1 warm-up discarded
            assert all(math.isfinite(v) and v >= 0 for v in m[key]["values"]), key
            assert m[key]["min"] <= m[key]["median"] <= m[key]["max"], key
        for phase in ("step", "rollout", "actor_train"):
            assert r["phases"][phase]["time_s"] > 0 and math.isfinite(r["phases"][phase]["time_s"])
        # the step encloses rollout and training; the CPU has no allocator peak to report
        for s, ro, tr in zip(m["perf/step_time"]["values"], m["perf/rollout_time"]["values"],
                             m["perf/actor_train_time"]["values"]):  # fmt: skip
            assert s >= ro + tr
        assert 0 <= m["perf/wait_time_ratio"]["median"] <= 1
        # MFU against the 1 TFLOP/s override equals the TFLOP/s figure, step by step
        # exact arithmetic (peak 1e12 FLOP/s): measured 0
        assert m["perf/actor_train_mfu"]["values"] == pytest.approx(m["perf/actor_train_tflops"]["values"])
        assert not any(k.startswith("perf/max_memory_allocated_gb/") for k in m)
        assert len(m["reward/mean"]["all_steps"]) == 3
        assert r["impl"].get("backend", r["backend"]) == r["backend"]
        # 32 sequences of a 3-token prompt (BOS, digit, '=') and 1 or 2 response tokens, no padding
        assert 32 * (3 + 1) <= r["fairness"]["real_tokens"] <= 32 * (3 + 2)
    # Same seed, same recipe: the first rollout happens before any update, so both backends score it alike.
    assert local["metrics"]["reward/mean"]["first"] == fsdp["metrics"]["reward/mean"]["first"]
    assert local["metrics"]["reward/mean"]["first"] == mega["metrics"]["reward/mean"]["first"]

    paths = write_matrix_report(out, tmp_path / "report")
    md = paths["markdown"].read_text()
    assert "# Benchmark matrix (rl-step)" in md and "| demo (tiny) | slipstream | fsdp | ok |" in md
    assert "| demo (tiny) | trl | accelerate | ok |" in md
    assert "- `demo/verl/fsdp` **not-available**: rl-step adapter for verl not written yet" in md
    assert "not measured (it is read from the CUDA allocator)" in md
    for name in ("phases", "mfu", "memory"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- report


def test_report_renders_rl_step_rows_with_memory():
    spec = parse_spec(_spec(frameworks=["slipstream", "trl"], backends=["fsdp"], device=None))
    rl = spec.rl_step
    env = {"gpu": "NVIDIA H200", "num_gpus": 1, "torch": "2.11.0", "transformers": "5.17.0", "cuda": "13.0",
           "python": "3.12", "git_commit": "abc1234", "time": "2026-12-02", "command": "slipstream bench matrix x.yaml"}  # fmt: skip

    def step(t, scale):
        return {"perf/step_time": t, "perf/rollout_time": t / 2, "perf/actor_train_time": t / 4,
                "perf/actor_train_tflops": 400.0 * scale, "perf/actor_train_mfu": 0.4 * scale,
                "perf/actor_train_tok_per_s": 20000.0 * scale, "perf/wait_time_ratio": 0.6,
                "perf/rollout_tokens_per_gpu_per_s": 5000.0 * scale, "perf/max_memory_allocated_gb/rollout": 30.0 * scale,
                "perf/max_memory_allocated_gb/actor_train": 60.0 * scale, "reward/mean": 0.1 * scale}  # fmt: skip

    metrics, phases = step_statistics([step(9.0, 0.5), step(2.0, 1.0), step(4.0, 1.5), step(3.0, 1.25)], 1)
    ok = {"status": "ok", "metrics": metrics, "phases": phases, "fairness": {"dtype": "bfloat16", "padding_fraction": 0.0}}
    na = {"status": "not-available", "reason": "rl-step adapter for trl not written yet"}
    rows = [make_row(spec, rl, "slipstream", "fsdp", ok, env), make_row(spec, rl, "trl", "fsdp", na, env)]
    md = markdown_table(rows)
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| workload |"))
    assert header.endswith("| peak GiB rollout | peak GiB actor_train |")
    slip = next(line for line in lines if line.startswith("| demo (tiny) | slipstream | fsdp | ok |"))
    # timed steps 2, 4, 3 s (the 9 s warm-up dropped): medians and min-max by hand; the scale goes 1, 1.5, 1.25
    expected = ["3.000 (2.000-4.000)", "1.500 (1.000-2.000)", "0.750 (0.500-1.000)", "| 500 |", "50.0%",
                "25,000", "60.0%", "6,250", "0.050 -> 0.125", "37.50", "75.00"]  # fmt: skip
    for cell in expected:
        assert cell in slip, cell
    assert slip.count("|") == header.count("|")
    trl = next(line for line in lines if line.startswith("| demo (tiny) | trl | fsdp | not-available |"))
    assert trl.count("|") == header.count("|")
    assert "- `demo/trl/fsdp` **not-available**: rl-step adapter for trl not written yet" in md
    assert "NVIDIA H200" in md and "`abc1234`" in md and "2 steps per cell, the first 1 discarded" not in md
    assert "3 steps per cell, the first 1 discarded" in md and "not measured" not in md


def test_trl_settings_follow_the_recipe():
    from benchmarks.peers.trl_rl_step import reward_function, task_dataset, trl_settings
    from slipstream.config.loader import load_config

    cfg = load_config(DEMO, ["algo.loss_agg=seq-mean-token-mean", "algo.kl_coef=0.05", "actor.grad_clip=0.5"])
    got = trl_settings(cfg)
    assert got["loss_type"] == "grpo" and got["beta"] == 0.05 and got["max_grad_norm"] == 0.5
    assert got["per_device_train_batch_size"] == 16 * 8 and got["num_generations"] == 8
    assert got["max_completion_length"] == 1 and got["learning_rate"] == 1e-3
    with pytest.raises(ValueError, match="no TRL loss_type equivalent"):
        trl_settings(load_config(DEMO, ["algo.loss_agg=seq-mean-token-sum"]))
    # recipe options TRL cannot express are refused, not dropped
    with pytest.raises(ValueError, match=r"algo.ppo_n_minibatches=2, algo.entropy_coef=0.01"):
        trl_settings(load_config(DEMO, ["algo.ppo_n_minibatches=2", "algo.entropy_coef=0.01"]))
    with pytest.raises(ValueError, match="algo.kl_estimator='k1'"):
        trl_settings(load_config(DEMO, ["algo.kl_coef=0.1", "algo.kl_estimator=k1"]))
    data, task = task_dataset(cfg, 5)
    assert len(data) == 5 and all(p.endswith("=") for p in data["prompt"])
    reward = reward_function(cfg, task)
    # the recipe's exact-match reward, called through TRL's signature
    assert reward(["7=", "3="], ["7", "4"], answer=["7", "3"]) == [1.0, 0.0]


def test_w1_budgets_and_ignored_stops_shape_every_sample(tmp_path):
    """rl_step.budgets=w1 gives sample i of a step the budget linspace(256, 3584)[i]; ignore_stop samples to it."""
    from slipstream.bench.rl_step import shape_rollout
    from slipstream.config import load_config
    from slipstream.controller.trainer import RLTrainer

    spec = parse_spec({
        "mode": "rl-step", "frameworks": ["slipstream"], "backends": ["local"],
        "rl_step": {"recipe": "recipes/demo.yaml", "steps": 2, "budgets": "w1", "ignore_stop": True},
    })  # fmt: skip
    rl = spec.rl_step
    budgets = rl.sample_budgets(64)
    assert budgets[0] == 256 and budgets[-1] == 3584 and len(set(budgets)) == 64
    cfg = load_config("recipes/demo.yaml", [f"trainer.run_dir={tmp_path}", "logging.tensorboard=false",
                                            "rollout.prompts_per_step=2", "rollout.group_size=3"])  # fmt: skip
    trainer = RLTrainer(cfg)
    try:
        shape_rollout(trainer, rl)
        trainer.stages.sample_budgets = [1, 2, 3, 4, 5, 6]  # short ones: the tiny model's context is 2048
        first, records = trainer.stages.my_share(trainer.prompts.next_batch())
        samples = trainer.stages.generate(records, first)
        assert trainer.stages.sampling.stop_token_ids == ()
        assert [len(s.response_ids) for s in samples] == [1, 2, 3, 4, 5, 6]
    finally:
        trainer.rewards.close()
        trainer.logger.close()


def test_trl_and_slipstream_train_the_same_tokens_on_the_id_tokenizer_recipe(tmp_path):
    """benchmarks/specs/matrix_rl_step_fixed_trl.yaml's recipe (random token ids, ids tokenizer), CPU-sized: TRL's cell
    builds it too and trains on it; slipstream's responses run to the budget (stop tokens ignored)."""
    overrides = ["model.preset=tiny", "model.tokenizer=ids:96", "data.task_params={length: 15, vocab_size: 96}",
                 "rollout.max_new_tokens=8", "actor.compile=false", "model.dtype=float32", "rollout.prompts_per_step=2",
                 "rollout.group_size=2", "actor.activation_checkpointing=none"]  # fmt: skip
    spec = parse_spec(_spec(
        {"recipe": "benchmarks/specs/recipe_w1_rl_step.yaml", "steps": 2, "warmup_steps": 1, "ignore_stop": True,
         "overrides": overrides}, frameworks=["slipstream", "trl"], backends=["fsdp"],
    ))  # fmt: skip
    rows = run_matrix(spec, tmp_path / "results.jsonl")
    assert [r["status"] for r in rows] == ["ok", "ok"], [r.get("reason") for r in rows]
    # 2 prompts x 2 samples x (15 prompt ids + 8 new) = 92; TRL stops a response at <eos> (id 95: a random
    # model draws it now and then), so its count is at most that (92 in the seeded run)
    slipstream, trl = (r["fairness"]["real_tokens"] for r in rows)
    assert slipstream == 92 and 2 * 2 * (15 + 1) <= trl <= 92
