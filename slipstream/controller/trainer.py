"""`RLTrainer`: builds the components of a run, then runs a loop over the shared stages.

The stages (controller/stages.py) carry typed records from prompts to a weight sync; the loop
(controller/loops.py) decides their order. The algorithm (advantage estimator, loss terms,
aggregation) is picked from registries when the trainer is built; neither the stages nor the
loop branch on it or on the backend. The trainer owns what outlives a step: the run directory,
signals, checkpoints, logging and the final export.

Several processes (`torchrun --nproc-per-node N slipstream train ...`, actor.backend fsdp or
megatron with data parallelism only) run the same loop: every data-parallel rank reads the same
prompts, generates and scores its share of the groups with its own rollout engine, and all
ranks gather the samples, so advantages and the packed batch are the same everywhere. Each rank
then trains on its share of the token-budget plan (the engines all-reduce loss denominators and
gradients) and refreshes its own rollout weights. Rank 0 writes the logs, the config and the HF
export; checkpoints hold every rank's engine shards and trainer state.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import asdict
from pathlib import Path

import torch

from slipstream.checkpoint.manager import CheckpointManager, trainer_file
from slipstream.config.loader import dump_yaml
from slipstream.config.schema import Config, parse_backend
from slipstream.controller import dynamic_sampling, setup
from slipstream.controller.loops import AsyncLoop, DisaggregatedLoop, SyncLoop
from slipstream.controller.placement import Placement, RemoteRollout, RolloutWorker, make_placement, staleness_bound
from slipstream.controller.prompts import PromptSource
from slipstream.controller.run_dir import RunComplete, config_changes, missing_outputs, open_run_dir, rewind_metrics
from slipstream.controller.stages import NonFiniteLoss, Stages
from slipstream.controller.watch import StallWatch, TruncationWatch
from slipstream.engine.distributed import all_reduce_, data_parallel_group
from slipstream.engine.distributed import rank as dp_rank
from slipstream.engine.distributed import world_size as dp_world_size
from slipstream.engine.factory import build_engine
from slipstream.eval import EvalSchedule, Evaluator, build_eval_sets, excluded_hashes, format_eval
from slipstream.logging import MetricsLogger
from slipstream.models import hf
from slipstream.perf.mfu import device_peak_flops

log = logging.getLogger(__name__)

__all__ = ["Interrupted", "NonFiniteLoss", "RLTrainer"]


class Interrupted(KeyboardInterrupt):
    """fit() stopped on Ctrl-C / SIGTERM after `step` steps. `saved`: the checkpoint written for the stop
    (None: a second Ctrl-C stopped the run at once, nothing was written); `resume_point`: the newest
    checkpoint on disk, where a rerun continues."""

    def __init__(self, step: int, saved: Path | None, resume_point: Path | None) -> None:
        super().__init__(f"interrupted after step {step}")
        self.step, self.saved, self.resume_point = step, saved, resume_point


def build_trainer(cfg: Config, *, overwrite: bool = False) -> "RLTrainer | RolloutWorker":
    """What this process runs: the trainer, or, on the rollout ranks of a disaggregated placement, a
    rollout worker (both have fit(), rank and run_dir)."""
    if cfg.placement.rollout_ranks > 0:
        if parse_backend(cfg.actor.backend)[0] == "megatron":  # its parallel state spans the whole world
            raise ValueError("placement.rollout_ranks runs the trainer ranks on actor.backend=local (one trainer "
                             "rank) or fsdp; megatron is not supported beside rollout ranks")  # fmt: skip
        placement = make_placement(cfg, setup.pick_device(cfg.trainer.device).type)
        if placement.role == "rollout":
            return RolloutWorker(cfg, placement)
        return RLTrainer(cfg, placement, overwrite=overwrite)
    return RLTrainer(cfg, overwrite=overwrite)


class RLTrainer:
    def __init__(self, cfg: Config, placement: Placement | None = None, *, overwrite: bool = False) -> None:
        """Build a run, or resume the one in trainer.run_dir. `overwrite` first removes an earlier run's
        output there; `placement` makes this process a trainer rank of a disaggregated run. Raises
        ValueError when the run directory cannot be used and `run_dir.RunComplete` when its run already
        reached trainer.total_steps (before building anything) with its final outputs written; one whose HF
        export is missing is built from its final checkpoint, to export."""
        self.cfg = cfg
        self.placement = placement
        # torchrun's environment; the engine's process group is created when the engine is built. With a
        # disaggregated placement the trainer's world is the trainer ranks (their data-parallel group).
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if placement is not None:
            self.rank, self.world = dp_rank(), dp_world_size()
        if self.world > 1 and parse_backend(cfg.actor.backend)[0] == "local":
            raise ValueError(
                f"{self.world} {'trainer ' if placement is not None else ''}processes need a distributed backend: "
                f"set actor.backend=fsdp{'' if placement is not None else ' (or megatron)'}; the local backend trains "
                "in one process"
            )
        dynamic_sampling.check_supported(cfg, self.world, disaggregated=placement is not None)
        setup.seed_everything(cfg.trainer.seed)
        self.device = setup.pick_device(cfg.trainer.device)
        self.finishing = False
        """The run was complete but its HF export is missing (a stop after the final checkpoint): fit()
        trains no step and only exports."""
        try:
            self.run_dir = open_run_dir(cfg.trainer, overwrite=overwrite, rank=self.rank)
        except RunComplete:
            if "hf" not in missing_outputs(cfg.trainer):
                raise
            self.run_dir, self.finishing = Path(cfg.trainer.run_dir), True
            log.warning("%s reached trainer.total_steps but has no hf/ export (stopped after its final "
                        "checkpoint): exporting it from that checkpoint", self.run_dir)  # fmt: skip

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
        if cfg.rollout.prompts_per_step % self.dp_size and placement is None:  # rollout ranks split their own way
            raise ValueError(
                f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                f"{self.dp_size} data-parallel ranks (each rank generates whole groups)"
            )
        self.ref = None
        if ref_model is not None:
            self.ref = build_engine(ref_model, self.device, compute_dtype, temperature, cfg.actor, forward_only=True)

        if placement is None:
            self.rollout = setup.build_rollout(cfg, self.model_cfg, self.device, compute_dtype)
        else:  # the rollout ranks generate; this side broadcasts weights and receives batches
            self.rollout = RemoteRollout(placement, self.device)
        self.sampling = setup.build_sampling(cfg, self.tokenizer, self.model_cfg)
        # eval problems are fixed first: the training stream skips every held-out one
        # prompts leaving no room for max_new_tokens in the model's context are dropped and counted, in
        # the eval sets and the training stream alike
        context = self.model_cfg.max_position_embeddings
        self.eval_sets = build_eval_sets(cfg, self.tokenizer, max_context=context)
        self.prompts = PromptSource(cfg, self.tokenizer, exclude=excluded_hashes(self.eval_sets), max_context=context)
        self.rewards = setup.build_rewards(cfg, self.prompts.reward_functions())
        self.evaluator = None
        self.eval_engine = None
        """With a disaggregated placement: the trainer ranks' own engine for evals, given the trainer's weights
        before each eval and asleep (cache freed, weights on the CPU) between them."""
        if self.eval_sets and placement is not None:
            self.eval_engine = setup.build_rollout(cfg, self.model_cfg, self.device, compute_dtype)
            self.eval_engine.sleep()
        if self.eval_sets:
            self.evaluator = Evaluator.build(
                cfg, self.tokenizer, self.eval_engine or self.rollout, self.eval_sets, list(self.sampling.stop_token_ids),
                train_rewards=self.rewards, train_functions=self.prompts.reward_functions(),
                rank=self.dp_rank, world=self.dp_size,
            )  # fmt: skip
        self.eval_schedule = EvalSchedule(cfg.eval.every_steps, cfg.eval.before_training, cfg.trainer.total_steps)
        self.truncation = TruncationWatch(cfg.rollout.max_new_tokens)
        stacks = "stacks.txt" if self.rank == 0 else f"stacks-rank{self.rank}.txt"
        self.stall = StallWatch(self.run_dir / stacks, cfg.trainer.stall_dump_s)
        peak_flops = device_peak_flops(
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu", cfg.trainer.peak_flops
        )
        self.stages = Stages(
            cfg=cfg, model_cfg=self.model_cfg, tokenizer=self.tokenizer, engine=self.engine, ref=self.ref,
            rollout=self.rollout, sampling=self.sampling, rewards=self.rewards,
            advantage_fn=setup.build_advantage_fn(cfg), loss_fn=setup.build_loss_fn(cfg),
            world=self.world, peak_flops=peak_flops,
        )  # fmt: skip
        self.stages.decoupled = setup.is_decoupled(cfg)
        if placement is not None:
            self.loop = DisaggregatedLoop(self.stages, staleness_bound(cfg))
        elif cfg.trainer.mode == "async":
            self.loop = AsyncLoop(self.stages, self.prompts)
        else:
            self.loop = SyncLoop(self.stages, self.prompts)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=cfg.trainer.keep_last)
        self.step_num = 0
        self._saved_step: int | None = None
        latest = self._agreed_latest_checkpoint()
        if latest is not None and placement is not None:
            raise ValueError(
                f"{latest} exists: resuming a run with placement.rollout_ranks is not supported yet; start a new "
                "trainer.run_dir"
            )
        if latest is not None:
            self._restore(latest)
        self.stages.sync_weights(version=self.step_num)
        if self.rank == 0:  # written once start-up is over: a run stopped before has left nothing behind
            rewind_metrics(self.run_dir, self.step_num)
            dump_yaml(cfg, self.run_dir / "config.yaml")
        self.logger = MetricsLogger([])
        if self.rank == 0:
            self.logger = setup.build_metrics_logger(cfg, self.run_dir, self.step_num)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> None:
        """Run until trainer.total_steps.

        Ctrl-C or SIGTERM asks for a stop: the current step finishes (so minibatch updates, the
        data position and the sampler RNG stay consistent), a checkpoint is saved, and Interrupted
        is raised with it. A second Ctrl-C stops at once (during the step or the save) and raises
        Interrupted without one: a save is atomic, so the newest complete checkpoint on disk is the
        resume point. Under torchrun the signal reaches the launcher, which forwards it once and
        kills the ranks after its `--shutdown-timeout` (30 s by default): give it the length of a
        step plus a save for the same guarantee.
        """
        stop_requested = False

        def on_signal(signum, frame):
            nonlocal stop_requested
            if stop_requested:
                raise KeyboardInterrupt
            stop_requested = True
            log.warning("stop requested: finishing step %d, then saving a checkpoint (Ctrl-C again stops at once, "
                        "without one)", self.step_num + 1)  # fmt: skip

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self._eval_due():  # the baseline before training (its own record, at step 0)
                with self.stall.phase(f"the eval at step {self.step_num}"):
                    self.logger.log(self.step_num, self.evaluate())
            while self.step_num < self.cfg.trainer.total_steps:
                with self.stall.phase(f"the stop check before step {self.step_num + 1}"):  # a collective
                    if self._any_rank(stop_requested):
                        break
                with self.stall.phase(f"step {self.step_num + 1}"):
                    metrics = self.step()
                if self._eval_due():  # after the step's weight sync: the rollout holds this policy
                    with self.stall.phase(f"the eval at step {self.step_num}"):
                        metrics.update(self.evaluate())
                self.logger.log(self.step_num, metrics)
                every = self.cfg.trainer.save_every
                if every and self.step_num % every == 0 and self.step_num < self.cfg.trainer.total_steps:
                    with self.stall.phase(f"the checkpoint at step {self.step_num}"):
                        self.save()
                    self._saved_step = self.step_num
            if self._saved_step != self.step_num:  # a stop right after a save_every save needs no second one
                with self.stall.phase(f"the checkpoint at step {self.step_num}"):
                    self.save()
                self._saved_step = self.step_num
        except KeyboardInterrupt:
            raise Interrupted(self.step_num, saved=None, resume_point=self.checkpoints.latest()) from None
        except NonFiniteLoss:
            log.error("stopping: non-finite loss or gradient at step %d; the optimizer step was skipped. "
                      "Lower actor.lr or check the rewards; a rerun resumes from the last checkpoint "
                      "(trainer.save_every)", self.step_num + 1)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()
        if self._any_rank(stop_requested):
            latest = self.checkpoints.latest()
            raise Interrupted(self.step_num, saved=latest, resume_point=latest)
        if self.cfg.trainer.export_hf:
            with self.stall.phase("the HF export"):
                self._export_hf()

    def _export_hf(self) -> None:
        """The policy as an HF checkpoint in run_dir/hf. Every rank iterates the export (the fsdp engine
        gathers each tensor); rank 0 keeps the tensors, on the CPU, and writes them."""
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
        if self.world == 1:
            return latest
        choice = [str(latest) if latest is not None else None]
        torch.distributed.broadcast_object_list(choice, src=0, group=data_parallel_group())  # trainer rank 0
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

    def close(self) -> None:
        """Stop what runs beside the trainer: the rollout producer (async), the loggers, the reward workers."""
        try:
            self.loop.close()
            self.logger.close()  # may raise (a logging backend's finish): the workers are stopped regardless
        finally:
            if self.evaluator is not None:
                self.evaluator.close(keep=self.rewards)
            self.rewards.close()

    def step(self) -> dict[str, float]:
        """One step of the loop; afterwards the policy (and the rollout's weights) are version step_num."""
        metrics = self.loop.step(self.step_num)
        self.step_num += 1
        metrics.update(self.prompts.metrics())
        self.truncation.update(self.step_num, metrics)
        return metrics

    def _eval_due(self) -> bool:
        return self.evaluator is not None and self.eval_schedule.due(self.step_num)

    def evaluate(self) -> dict[str, float]:
        """Eval metrics of the current policy (eval/<set>/..., perf/eval_time); the schedule marks this step done.

        Its time is its own phase: it is not part of perf/step_time, the throughput figures or the
        wait ratios, which the loop measured before.
        """
        if self.eval_engine is not None:  # every trainer rank iterates the export (FSDP gathers collectively)
            self.eval_engine.update_weights(self.engine.export_weights(), version=self.step_num)
        with self.loop.paused():
            metrics = self.evaluator.run()
        if self.eval_engine is not None:
            self.eval_engine.sleep()
        self.eval_schedule.last_step = self.step_num
        if self.rank == 0:
            log.info("%s", format_eval(self.step_num, metrics, self.eval_sets))
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        state = {"data": self.prompts.state_dict(), "rollout": self.rollout.state_dict(),
                 "loop": self.loop.state_dict(self.step_num), "eval": self.eval_schedule.state_dict(),
                 "config": asdict(self.cfg)}
        barrier = (lambda: torch.distributed.barrier(group=data_parallel_group())) if self.world > 1 else None
        path = self.checkpoints.save(self.step_num, self.engine.save, state, rank=self.rank, barrier=barrier)
        if self.rank == 0:
            log.info("saved checkpoint %s", path)
        return path

    def _restore(self, directory: Path) -> None:
        self.engine.load(directory)
        state = self.checkpoints.load_trainer_state(directory, self.rank)
        # trainer.total_steps is expected to change on resume
        changed = [c for c in config_changes(state.get("config", {}), asdict(self.cfg))
                   if not c.startswith("trainer.total_steps:")]  # fmt: skip
        if changed:
            log.warning("resuming with a config that differs from the checkpoint's: %s", "; ".join(changed))
        self.prompts.load_state_dict(state["data"])
        self.rollout.load_state_dict(state["rollout"])
        self.loop.load_state_dict(state.get("loop", {}))
        if "eval" in state:  # checkpoints from before evals continue the schedule from here
            self.eval_schedule.load_state_dict(state["eval"])
        self.step_num = self._saved_step = int(state["step"])
        log.info("resumed from %s at step %d", directory, self.step_num)

