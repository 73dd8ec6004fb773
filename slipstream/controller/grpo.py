"""The synchronous RL loop: rollout -> rewards -> advantages -> update -> weight sync.

One `RLTrainer.step()` reads top to bottom like the data flow in docs/architecture.md. The
algorithm (advantage estimator, loss terms, aggregation) is picked from registries when the
trainer is built; the loop itself never branches on it or on the backend.

Several processes (`torchrun --nproc-per-node N slipstream train ...`, actor.backend fsdp or
megatron with data parallelism only) run the same loop: every data-parallel rank reads the same
prompts, generates and scores its share of the groups with its own rollout engine, and all
ranks gather the samples, so advantages and the packed batch are the same everywhere. Each rank
then trains on its share of the token-budget plan (the engines all-reduce loss denominators and
gradients) and refreshes its own rollout weights. Rank 0 writes the logs, the config and the HF
export; checkpoints hold every rank's engine shards and trainer state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
from dataclasses import asdict, replace
from pathlib import Path

import torch

from slipstream.algo.advantages import get_advantage_fn
from slipstream.algo.losses import LossSpec, SpecLoss
from slipstream.batching.packing import pack_samples, select
from slipstream.batching.planner import quadratic_scale_for, split_minibatches
from slipstream.batching.records import PackedBatch, Sample
from slipstream.checkpoint.manager import CheckpointManager, saved_rank_count, trainer_file
from slipstream.config.loader import dump_yaml
from slipstream.config.schema import Config, parse_backend
from slipstream.controller import setup
from slipstream.controller.prompts import PromptSource
from slipstream.engine.distributed import all_reduce_
from slipstream.engine.factory import build_engine, gather_per_token, local_micro_batches
from slipstream.engine.local import OutOfMemory
from slipstream.logging import MetricsLogger, build_sinks
from slipstream.models import hf
from slipstream.perf.mfu import device_peak_flops
from slipstream.perf.timers import PhaseTimer, perf_metrics
from slipstream.rewards.runner import RewardRunner
from slipstream.rollout.base import SamplingParams
from slipstream.rollout.builtin import BuiltinRollout

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    pass


class RLTrainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        # torchrun's environment; the engine's process group is created when the engine is built
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if self.world > 1 and parse_backend(cfg.actor.backend)[0] == "local":
            raise ValueError(
                f"{self.world} processes need a distributed backend: set actor.backend=fsdp (or megatron); "
                "the local backend trains in one process"
            )
        setup.seed_everything(cfg.trainer.seed)
        self.device = setup.pick_device(cfg.trainer.device)
        self.run_dir = setup.prepare_run_dir(cfg.trainer.run_dir)
        if self.rank == 0:
            dump_yaml(cfg, self.run_dir / "config.yaml")

        self.tokenizer = setup.build_tokenizer(cfg)
        model, self.model_cfg = setup.build_policy(cfg, len(self.tokenizer))
        compute_dtype = setup.DTYPES[cfg.model.dtype]
        temperature = cfg.rollout.temperature
        ref_model = None
        if cfg.algo.kl_coef > 0:  # the reference is the initial policy, frozen; copied before
            with torch.device("meta"):  # parallelize() rewrites the actor in place. Built on meta and
                ref_model = type(model)(self.model_cfg)  # filled with copies: no wasted random init
            ref_model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        self.engine = build_engine(model, self.device, compute_dtype, temperature, cfg.actor)
        self.device = self.engine.device
        self.dp_rank, self.dp_size = self.engine.dp_rank, self.engine.dp_size
        if self.dp_size != self.world:
            raise ValueError(
                f"slipstream train over several processes supports data parallelism only (got {self.world} "
                f"processes, {self.dp_size} data-parallel ranks from actor.backend={cfg.actor.backend!r}); "
                "tensor / pipeline parallel layouts run under `slipstream bench train-step`"
            )
        if cfg.rollout.prompts_per_step % self.dp_size:
            raise ValueError(
                f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                f"{self.dp_size} data-parallel ranks (each rank generates whole groups)"
            )
        self.ref = None
        if ref_model is not None:
            self.ref = build_engine(ref_model, self.device, compute_dtype, temperature, cfg.actor, forward_only=True)

        rollout_dtype = compute_dtype if self.device.type == "cuda" else torch.float32
        # each data-parallel rank samples its own groups: its own random stream
        self.rollout = BuiltinRollout(
            self.model_cfg, self.device, rollout_dtype, max_batch_size=cfg.rollout.max_batch_size,
            seed=cfg.rollout.seed + 1_000_003 * self.dp_rank,
        )  # fmt: skip
        self.sampling = SamplingParams(
            temperature=temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=setup.stop_token_ids(self.tokenizer, cfg.rollout.stop, self.model_cfg.eos_token_id),
            n=cfg.rollout.group_size,
        )
        self.prompts = PromptSource(cfg, self.tokenizer)
        self.rewards = RewardRunner(
            list(zip(self.prompts.reward_functions(), cfg.reward.weights or [1.0] * len(self.prompts.reward_functions()))),
            num_workers=cfg.reward.num_workers,
            timeout_s=cfg.reward.timeout_s,
            on_error=cfg.reward.on_error,
            error_score=cfg.reward.error_score,
        )
        # std_normalize is GRPO's switch (False = Dr.GRPO); the other estimators use their own default
        adv_options = {"std_normalize": cfg.algo.std_normalize} if cfg.algo.advantage == "grpo" else {}
        if cfg.algo.advantage != "grpo" and not cfg.algo.std_normalize:
            log.warning("algo.std_normalize=false is ignored by algo.advantage=%s (it applies to grpo)",
                        cfg.algo.advantage)
        self.advantage_fn = get_advantage_fn(cfg.algo.advantage, **adv_options)
        self.loss_fn = SpecLoss(
            LossSpec(
                clip_low=cfg.algo.clip_low,
                clip_high=cfg.algo.clip_high,
                dual_clip_c=cfg.algo.dual_clip_c,
                kl_coef=cfg.algo.kl_coef,
                kl_estimator=cfg.algo.kl_estimator,
                entropy_coef=cfg.algo.entropy_coef,
                agg_mode=cfg.algo.loss_agg,
                behav_is_cap=cfg.algo.behav_is_cap,
            )
        )
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=cfg.trainer.keep_last)
        self.peak_flops = device_peak_flops(
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu", cfg.trainer.peak_flops
        )
        self.step_num = 0
        self._saved_step: int | None = None
        latest = self._agreed_latest_checkpoint()
        if latest is not None and not cfg.trainer.resume:
            raise ValueError(
                f"trainer.run_dir={cfg.trainer.run_dir!r} already holds checkpoints (newest {latest.name}) and "
                "trainer.resume=false: pick a new trainer.run_dir, or set trainer.resume=true to continue that run"
            )
        if latest is not None:
            self._restore(latest)
        self.rollout.update_weights(self.engine.export_weights(), version=self.step_num)
        self.logger = MetricsLogger(
            build_sinks(self.run_dir, total_steps=cfg.trainer.total_steps, tensorboard=cfg.trainer.tensorboard,
                        log_every=cfg.trainer.log_every, start_step=self.step_num)
            if self.rank == 0 else []
        )  # fmt: skip

    # ------------------------------------------------------------------ the loop
    def fit(self) -> None:
        """Run until trainer.total_steps.

        Ctrl-C or SIGTERM asks for a stop: the current step finishes (so minibatch updates, the
        data position and the sampler RNG stay consistent), a checkpoint is saved, and
        KeyboardInterrupt is raised. A second Ctrl-C aborts at once without saving; the last
        checkpoint on disk is then the resume point. Under torchrun the signal reaches the
        launcher, which forwards it once and kills the ranks after its `--shutdown-timeout`
        (30 s by default): give it the length of a step plus a save for the same guarantee.
        """
        stop_requested = False

        def on_signal(signum, frame):
            nonlocal stop_requested
            if stop_requested:
                raise KeyboardInterrupt
            stop_requested = True
            log.warning("stop requested: finishing step %d, then saving (Ctrl-C again aborts without saving)",
                        self.step_num + 1)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self.step_num < self.cfg.trainer.total_steps and not self._any_rank(stop_requested):
                metrics = self.step()
                self.logger.log(self.step_num, metrics)
                every = self.cfg.trainer.save_every
                if every and self.step_num % every == 0 and self.step_num < self.cfg.trainer.total_steps:
                    self.save()
                    self._saved_step = self.step_num
        except KeyboardInterrupt:
            log.warning("aborted during step %d without saving; the last checkpoint is the resume point",
                        self.step_num + 1)
            raise
        except NonFiniteLoss:
            log.error("stopping: non-finite loss or gradient at step %d; the optimizer step was skipped. "
                      "Lower actor.lr or check the rewards; a rerun resumes from the last checkpoint "
                      "(trainer.save_every)", self.step_num + 1)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.logger.close()
            self.rewards.close()
        if self._saved_step != self.step_num:  # a stop right after a save_every save needs no second one
            self.save()
        if self._any_rank(stop_requested):
            raise KeyboardInterrupt
        if self.cfg.trainer.export_hf:
            # every rank iterates (the fsdp engine gathers each tensor); rank 0 keeps them, on the CPU
            weights = {}
            for name, tensor in self.engine.export_weights():
                if self.rank == 0:
                    weights[hf.from_hf_name(name)] = tensor.cpu()
            if self.rank == 0:
                out = hf.save_pretrained(weights, self.model_cfg, self.run_dir / "hf", tokenizer=self.tokenizer)
                log.info("exported the policy as an HF checkpoint to %s", out)

    def _agreed_latest_checkpoint(self) -> Path | None:
        """The newest checkpoint, as rank 0 sees it, on every rank; every rank must find its own trainer file."""
        latest = self.checkpoints.latest()
        if latest is not None and self.rank == 0:
            saved_ranks = saved_rank_count(latest)
            if saved_ranks > self.world:
                log.warning("%s was saved by %d processes, this run has %d: the samplers of ranks %d.. start from "
                            "their saved states no more (their share of the groups moves to other ranks)",
                            latest, saved_ranks, self.world, self.world)
        if self.world == 1:
            return latest
        choice = [str(latest) if latest is not None else None]
        torch.distributed.broadcast_object_list(choice, src=0)
        latest = Path(choice[0]) if choice[0] is not None else None
        if latest is not None:
            missing = all_reduce_(torch.tensor([int(not (latest / trainer_file(self.rank)).exists())]))
            if int(missing[0]):
                raise ValueError(
                    f"{latest} was saved by a run with fewer processes ({int(missing[0])} of {self.world} ranks find "
                    "no trainer state of their own there, or trainer.run_dir is not shared by all ranks); resume "
                    "with the same number of processes or start a new trainer.run_dir"
                )
        return latest

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (a stop request reaches ranks at different moments)."""
        return bool(all_reduce_(torch.tensor([int(flag)]), op=torch.distributed.ReduceOp.MAX)[0])

    def step(self) -> dict[str, float]:
        cfg = self.cfg
        timer = PhaseTimer(self.device)
        with timer.phase("step"):
            # every rank reads the same prompts and generates the groups of its share of them
            records = self.prompts.next_batch()
            first = self.dp_rank * len(records) // self.dp_size
            records = records[first : first + len(records) // self.dp_size]
            with timer.phase("rollout"), _rollout_oom_advice(cfg):
                groups = self.rollout.generate([r.prompt_ids for r in records], self.sampling)
            samples = [
                replace(s, group_id=first + g, prompt_text=r.prompt_text, answer=r.answer)
                for g, (r, group) in enumerate(zip(records, groups))
                for s in group
            ]
            with timer.phase("reward"):
                samples = self._score(samples)
            if self.world > 1:
                with timer.phase("gather_samples"):
                    samples = self._gather_samples(samples)
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
            group_ids = torch.tensor([s.group_id for s in samples])
            seq_adv = self.advantage_fn(rewards, group_ids)
            batch = pack_samples(samples, seq_adv, indices=list(range(len(samples))))
            batch = self._attach_logprobs(batch, timer)
            with timer.phase("actor_train"):
                train_metrics = self._train(batch)
            self.step_num += 1
            with timer.phase("update_weights"):
                self.rollout.update_weights(self.engine.export_weights(), version=self.step_num)
        metrics = {**train_metrics, **self._sample_metrics(samples, rewards)}
        metrics["perf/num_dp_ranks"] = float(self.dp_size)
        metrics.update(timer.summary())
        metrics.update(
            perf_metrics(
                self.model_cfg,
                seq_lens=batch.seq_lens(),
                response_lens=[len(s.response_ids) for s in samples],
                times=self._slowest_rollout(timer.times),
                train_passes=cfg.algo.ppo_epochs,
                world_size=self.world,
                peak_flops=self.peak_flops,
            )
        )
        return metrics

    # ------------------------------------------------------------------ stages
    def _score(self, samples: list[Sample]) -> list[Sample]:
        texts = self.tokenizer.batch_decode([list(s.response_ids) for s in samples], skip_special_tokens=True)
        scored = self.rewards.score([(t, s.answer, s.prompt_text) for t, s in zip(texts, samples)])
        return [
            replace(s, response_text=t, reward=float(r), reward_info=info)
            for s, t, (r, info) in zip(samples, texts, scored)
        ]

    def _slowest_rollout(self, times: dict[str, float]) -> dict[str, float]:
        """Phase times for the throughput metrics: with several ranks the rollout phase is the slowest rank's
        (the others wait for it in gather_samples), so rollout tokens/s per GPU is not overstated."""
        if "rollout" in times:  # (all_reduce_ is a no-op in one process)
            slowest = all_reduce_(torch.tensor([times["rollout"]], dtype=torch.float64), op=torch.distributed.ReduceOp.MAX)
            times = {**times, "rollout": float(slowest[0])}
        return times

    def _gather_samples(self, samples: list[Sample]) -> list[Sample]:
        """Every rank's scored samples on every rank, in group order (the one-process order)."""
        gathered: list = [None] * self.world
        torch.distributed.all_gather_object(gathered, samples)
        return sorted((s for part in gathered for s in part), key=lambda s: s.group_id)

    def _micro_batches(self, batch: PackedBatch) -> tuple[list[PackedBatch], list[tuple[int, ...]]]:
        """This rank's token-budget micro-batches (and their sequence ids) of a plan balanced over the
        data-parallel ranks by estimated work (linear + attention term of this model)."""
        return local_micro_batches(
            batch, self.cfg.actor.max_tokens_per_mb, planner=self.cfg.actor.planner,
            rank=self.dp_rank, world=self.dp_size, quadratic_scale=quadratic_scale_for(self.model_cfg),
        )  # fmt: skip

    def _attach_logprobs(self, batch: PackedBatch, timer: PhaseTimer) -> PackedBatch:
        """Old log-probs when the batch is used for more than one update; ref log-probs for the KL term."""
        updates = self.cfg.algo.ppo_n_minibatches * self.cfg.algo.ppo_epochs
        mbs, ids = self._micro_batches(batch) if (updates > 1 or self.ref is not None) else ([], [])
        if updates > 1:
            with timer.phase("old_log_probs"):
                outs = self.engine.forward_logprobs(mbs)
                batch = batch.with_(old_logprobs=gather_per_token([o.logprobs.cpu() for o in outs], ids, batch))
        if self.ref is not None:
            with timer.phase("ref_log_probs"):
                outs = self.ref.forward_logprobs(mbs)
                batch = batch.with_(ref_logprobs=gather_per_token([o.logprobs.cpu() for o in outs], ids, batch))
        return batch

    def _train(self, batch: PackedBatch) -> dict[str, float]:
        cfg = self.cfg
        sums: dict[str, float] = {}
        count = 0
        for epoch in range(cfg.algo.ppo_epochs):
            # With several minibatches, each epoch visits the groups in a fresh order. The generator is
            # seeded from (seed, step, epoch), so a resumed run shuffles exactly as the original did.
            shuffle = None
            if cfg.algo.ppo_n_minibatches > 1:
                shuffle = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + self.step_num * 1_009 + epoch)
            minibatches = split_minibatches(batch.num_seqs, cfg.algo.ppo_n_minibatches, cfg.rollout.group_size,
                                            generator=shuffle)
            for seq_ids in minibatches:
                mbs, _ = self._micro_batches(select(batch, seq_ids))
                metrics = self.engine.forward_backward(mbs, self.loss_fn, max_response_len=cfg.rollout.max_new_tokens)
                metrics.update(self.engine.optim_step())
                if cfg.trainer.stop_on_nan and not all(map(math.isfinite, metrics.values())):
                    raise NonFiniteLoss(f"non-finite training metrics: {metrics}")
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
        return {key: value / count for key, value in sums.items()}

    def _sample_metrics(self, samples: list[Sample], rewards: torch.Tensor) -> dict[str, float]:
        resp = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        # unweighted score of each reward function (CombinedReward puts them in reward_info)
        per_fn: dict[str, list[float]] = {}
        for s in samples:
            for name, value in s.reward_info.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    per_fn.setdefault(name, []).append(float(value))
        group = rewards.view(-1, self.cfg.rollout.group_size)
        return {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "reward/max": float(rewards.max()),
            "reward/zero_adv_group_frac": float((group.min(dim=1).values == group.max(dim=1).values).float().mean()),
            "reward/error_frac": sum("error" in s.reward_info for s in samples) / len(samples),
            "rollout/response_len_mean": float(resp.mean()),
            "rollout/response_len_max": float(resp.max()),
            "rollout/stop_frac": sum(s.finish_reason == "stop" for s in samples) / len(samples),
            "rollout/policy_version": float(self.step_num - 1),
            **{f"reward/{name}": sum(v) / len(v) for name, v in per_fn.items() if len(v) == len(samples)},
        }

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        state = {"data": self.prompts.state_dict(), "rollout": self.rollout.state_dict(),
                 "config": asdict(self.cfg)}
        barrier = torch.distributed.barrier if self.world > 1 else None
        path = self.checkpoints.save(self.step_num, self.engine.save, state, rank=self.rank, barrier=barrier)
        if self.rank == 0:
            log.info("saved checkpoint %s", path)
        return path

    def _restore(self, directory: Path) -> None:
        self.engine.load(directory)
        state = self.checkpoints.load_trainer_state(directory, self.rank)
        changed = _config_changes(state.get("config", {}), asdict(self.cfg))
        if changed:
            log.warning("resuming with a config that differs from the checkpoint's: %s", "; ".join(changed))
        self.prompts.load_state_dict(state["data"])
        self.rollout.load_state_dict(state["rollout"])
        self.step_num = int(state["step"])
        log.info("resumed from %s at step %d", directory, self.step_num)


def _config_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ (trainer.total_steps is expected to change on resume)."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += _config_changes(a, b, f"{prefix}{key}.")
        elif a != b and f"{prefix}{key}" != "trainer.total_steps":
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


@contextlib.contextmanager
def _rollout_oom_advice(cfg: Config):
    """Turn an OOM during generation into an error naming the settings that size the KV cache."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        raise OutOfMemory(
            f"out of memory while generating: lower rollout.max_batch_size (now {cfg.rollout.max_batch_size}) "
            f"or rollout.max_new_tokens (now {cfg.rollout.max_new_tokens}). Original error: {err}"
        ) from err
