"""`slipstream train` over 2 processes (gloo, CPU): data parallel GRPO steps, as under torchrun.

Every rank generates its share of the groups, all ranks gather the samples and train on their
share of the plan. Checked here: the ranks agree on every step's samples and metrics and end
with identical weights; rank 0 alone writes logs; a 2-rank run resumes exactly; the demo
task is learned with 2 ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from slipstream.config import load_config
from slipstream.controller.trainer import RLTrainer
from slipstream.engine.distributed import destroy_distributed, free_port

SMALL = (
    "rollout.prompts_per_step=4", "rollout.group_size=4", "algo.kl_coef=0.01", "algo.ppo_n_minibatches=2",
    "logging.tensorboard=false", "trainer.save_every=2", "eval.sets={}",  # evals: test_two_ranks_agree_and_rank0_writes
)  # fmt: skip
SAME_ON_EVERY_RANK = ("reward/", "rollout/", "actor/")


def _worker(
    rank: int, world: int, port: int, run_dir: str, steps: int, extra: tuple[str, ...], out: str,
) -> None:  # fmt: skip
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    try:
        cfg = load_config("recipes/demo.yaml", [
            "actor.backend=fsdp", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", *extra,
        ])  # fmt: skip
        trainer = RLTrainer(cfg)
        seen: list[dict] = []
        log = trainer.logger.log
        trainer.logger.log = lambda step, metrics: (seen.append({"step": step, **metrics}), log(step, metrics))
        trainer.fit()
        weights = {name: t.clone() for name, t in trainer.engine.export_weights()}
        torch.save({"metrics": seen, "weights": weights}, Path(out) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


def _run(tmp_path: Path, name: str, steps: int, extra: tuple[str, ...] = SMALL, world: int = 2) -> list[dict]:
    out = tmp_path / f"{name}-out"
    out.mkdir(exist_ok=True)
    args = (world, free_port(), str(tmp_path / name), steps, extra, str(out))
    mp.spawn(_worker, args=args, nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _agreed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith(SAME_ON_EVERY_RANK)}


# a held-out eval set: each rank evaluates every other problem, the results are gathered
EVAL = ("data.task_params={num_terms: 2}", "eval.sets={sums: {size: 24}}", "eval.n=2")


def test_two_ranks_agree_and_rank0_writes(tmp_path):
    r0, r1 = _run(tmp_path, "a", 4, SMALL + EVAL)
    evals = [[{k: v for k, v in m.items() if k.startswith("eval/")} for m in r["metrics"]] for r in (r0, r1)]
    assert evals[0] == evals[1] and evals[0][0]["eval/sums/num_problems"] == 24  # both ranks: the whole set
    assert [m["step"] for m in r0["metrics"]] == [0, 1, 2, 3, 4]  # step 0: the eval before training
    assert {"eval/sums/accuracy", "eval/sums/pass@2", "eval/sums/maj@2"} <= set(r0["metrics"][-1])
    r0["metrics"], r1["metrics"] = r0["metrics"][1:], r1["metrics"][1:]
    assert len(r0["metrics"]) == len(r1["metrics"]) == 4
    for a, b in zip(r0["metrics"], r1["metrics"]):
        assert _agreed(a) == _agreed(b), a["step"]  # the same gathered samples, the same summed losses
        assert a["perf/num_dp_ranks"] == 2.0
        # the loss covers every sample of the step, not one rank's share: 16 one-token responses
        assert a["actor/num_loss_tokens"] == 4 * 4 / 2  # per minibatch (2 minibatches)
    assert r0["weights"].keys() == r1["weights"].keys()
    for name in r0["weights"]:
        assert torch.equal(r0["weights"][name], r1["weights"][name]), name
    run = tmp_path / "a"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 5  # rank 0 only
    step4 = run / "checkpoints" / "step_000004"
    assert (step4 / "trainer.pt").exists() and (step4 / "trainer_rank1.pt").exists()
    assert (run / "hf" / "config.json").exists()
    # the ranks generated different groups: four distinct prompts' worth of samples per step
    assert r0["metrics"][0]["rollout/response_len_mean"] == 1.0


REWARD = Path(__file__).resolve().parents[1] / "unit" / "rewards_fixtures.py"
# Groups of 3 (odd: the planner's shares differ between the log-prob pass and the minibatches), 3-token
# responses, varied rewards, KL to the reference, 2 minibatches x 2 epochs, small micro-batches.
EQUIV = (
    "rollout.prompts_per_step=8", "rollout.group_size=3", "rollout.max_new_tokens=3", "algo.kl_coef=0.05",
    "algo.ppo_n_minibatches=2", "algo.ppo_epochs=2", "actor.max_tokens_per_mb=16", "logging.tensorboard=false",
    "trainer.export_hf=false", f"reward.functions=[{REWARD}:char_code_reward]", "eval.sets={}",
)  # fmt: skip


def test_two_ranks_train_like_one_process(tmp_path):
    """2 ranks take the steps 1 process takes. The samples are the same (a sample's randomness depends on
    its prompt's position in the data stream, not on the rank that generates it); then the gathered
    samples in group order, the other rank's old / ref log-probs, the global loss denominators and the
    summed gradients all have to be right for this to hold."""
    (one,) = _run(tmp_path, "one", 3, EQUIV, world=1)
    two, _ = _run(tmp_path, "two", 3, EQUIV, world=2)
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        keys = [k for k in _agreed(a) if k != "actor/num_micro_batches"]  # that one is per rank
        assert a["reward/std"] > 0 and a["actor/kl"] != 0  # the test exercises advantages and the KL term
        for key in keys:
            # measured max |diff| 1.2e-07 (rel 3.3e-07) between 1 and 2 gloo ranks: 3x margin
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), (a["step"], key)
    for name in one["weights"]:
        # measured max |diff| 5.6e-07: 3.6x margin
        torch.testing.assert_close(two["weights"][name], one["weights"][name], atol=2e-6, rtol=0)


def test_two_ranks_resume_exactly(tmp_path):
    straight, _ = _run(tmp_path, "a", 4)
    _run(tmp_path, "b", 2)
    resumed, _ = _run(tmp_path, "b", 4)  # picks up step 2, with each rank's own sampler state
    assert [m["step"] for m in resumed["metrics"]] == [3, 4]
    for a, b in zip(straight["metrics"][2:], resumed["metrics"]):
        assert _agreed(a) == _agreed(b), a["step"]
    for name in straight["weights"]:
        assert torch.equal(straight["weights"][name], resumed["weights"][name]), name


def test_two_ranks_learn_the_demo(tmp_path):
    r0, _ = _run(tmp_path, "demo", 120, ("logging.tensorboard=false", "trainer.export_hf=false", "eval.sets={}"))
    rewards = [m["reward/mean"] for m in r0["metrics"]]
    assert sum(rewards[:10]) / 10 < 0.2
    assert sum(rewards[-10:]) / 10 > 0.8


@pytest.mark.parametrize("override, message", [
    ("actor.backend=local", "need a distributed backend"),
    ("rollout.prompts_per_step=3", "must be divisible by the 2 data-parallel ranks"),
])  # fmt: skip
def test_two_rank_config_errors(tmp_path, override, message):
    with pytest.raises(Exception) as err:
        _run(tmp_path, "bad", 1, ("logging.tensorboard=false", override))
    assert message in str(err.value)


def test_two_ranks_refuse_a_one_process_checkpoint(tmp_path):
    _run(tmp_path, "run", 2, SMALL, world=1)
    with pytest.raises(Exception) as err:
        _run(tmp_path, "run", 4, SMALL, world=2)
    assert "saved by a run with fewer processes" in str(err.value)


def test_one_process_resumes_a_two_rank_checkpoint(tmp_path):
    """Fewer processes than saved: the engine reshards (DCP); sampling needs no per-rank state."""
    _run(tmp_path, "run", 2, SMALL, world=2)
    (resumed,) = _run(tmp_path, "run", 4, SMALL, world=1)
    assert [m["step"] for m in resumed["metrics"]] == [3, 4]


def _disaggregated_worker(rank: int, world: int, port: int, run_dir: str, steps: int, extra: tuple, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    try:
        from slipstream.controller.trainer import build_trainer

        cfg = load_config("recipes/demo.yaml", [
            f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "placement.rollout_ranks=1", *extra,
        ])  # fmt: skip
        trainer = build_trainer(cfg)
        seen: list[dict] = []
        if isinstance(trainer, RLTrainer):
            log = trainer.logger.log
            trainer.logger.log = lambda step, metrics: (seen.append({"step": step, **metrics}), log(step, metrics))
        trainer.fit()
        torch.save({"metrics": seen, "role": type(trainer).__name__}, Path(out) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disaggregated_rollout_rank_and_trainer_rank_learn_the_demo(tmp_path, mode):
    """1 rollout rank + 1 trainer rank (gloo): batches travel to the trainer, weights back to the rollout; the
    demo is learned, and in async mode (max_staleness 1) generation runs one version behind."""
    out = tmp_path / "out"
    out.mkdir()
    extra = ("logging.tensorboard=false", "trainer.export_hf=false", f"trainer.mode={mode}", "trainer.max_staleness=1",
             "eval.every_steps=60")  # fmt: skip
    mp.spawn(_disaggregated_worker, args=(2, free_port(), str(tmp_path / "run"), 120, extra, str(out)), nprocs=2,
             join=True)  # fmt: skip
    trainer, rollout = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert (trainer["role"], rollout["role"]) == ("RLTrainer", "RolloutWorker")
    # the demo's eval runs on the trainer rank's own engine (asleep between evals): before training and every 60
    evals = {m["step"]: m["eval/sum/accuracy"] for m in trainer["metrics"] if "eval/sum/accuracy" in m}
    assert sorted(evals) == [0, 60, 120] and evals[0] < 0.5 and evals[120] >= 0.8, evals
    trainer["metrics"] = [m for m in trainer["metrics"] if "reward/mean" in m]
    rewards = [m["reward/mean"] for m in trainer["metrics"]]
    assert len(rewards) == 120
    assert sum(rewards[:10]) / 10 < 0.2 and sum(rewards[-10:]) / 10 > 0.8
    lags = [m["async/staleness_max"] for m in trainer["metrics"]]
    assert max(lags) == (1 if mode == "async" else 0)
    # the rollout rank's own wait, sent with each batch; in sync mode it waits for every step's weights
    waits = [m["perf/rollout_wait_ratio"] for m in trainer["metrics"]]
    assert all(0.0 <= w <= 1.0 for w in waits) and (mode == "async" or min(waits[1:]) > 0.0)


def test_disaggregated_trains_the_same_on_one_and_two_fsdp_trainer_ranks(tmp_path):
    """FSDP2 on the trainer ranks only: its mesh, collectives and checkpoints are the trainer group's, so the
    rollout rank (in the world, not in the group) neither blocks them nor counts as a data-parallel rank; 1 and
    2 trainer ranks next to one rollout rank take the same steps."""
    extra = ("logging.tensorboard=false", "trainer.export_hf=false", "eval.sets={}", "trainer.mode=async",
             "actor.backend=fsdp", "trainer.save_every=2")  # fmt: skip
    runs = {}
    for world in (2, 3):
        out = tmp_path / f"out{world}"
        out.mkdir()
        mp.spawn(_disaggregated_worker, args=(world, free_port(), str(tmp_path / f"run{world}"), 4, extra, str(out)),
                 nprocs=world, join=True)  # fmt: skip
        ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
        assert [r["role"] for r in ranks] == ["RLTrainer"] * (world - 1) + ["RolloutWorker"]
        assert sorted(p.name for p in (tmp_path / f"run{world}" / "checkpoints").iterdir()) == ["step_000002",
                                                                                               "step_000004"]
        runs[world] = ranks[0]["metrics"]
    assert [m["step"] for m in runs[3]] == [1, 2, 3, 4]
    assert [m["reward/mean"] for m in runs[3]] == [m["reward/mean"] for m in runs[2]]
    # the same loss summed in another order (two shards): measured up to 1.2e-4 relative (0.0013363 vs 0.0013365),
    # and 9e-10 where one side is exactly 0
    assert [m["actor/pg_loss"] for m in runs[3]] == pytest.approx([m["actor/pg_loss"] for m in runs[2]], rel=1e-3, abs=1e-6)


def test_megatron_beside_rollout_ranks_is_refused_before_any_process_group():
    """Megatron's parallel state spans the whole world: beside rollout ranks every rank stops with one message
    instead of hanging in its set-up."""
    from slipstream.controller.trainer import build_trainer

    cfg = load_config("recipes/demo.yaml", ["placement.rollout_ranks=1", "actor.backend=megatron"])
    with pytest.raises(ValueError, match="megatron is not supported beside rollout ranks"):
        build_trainer(cfg)
    assert not torch.distributed.is_initialized()
