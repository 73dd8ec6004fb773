"""The stages of an RL step, shared by the sync and async loops (controller/loops.py).

Each stage takes and returns typed records (`Sample`, `PackedBatch`) or metrics:

    generate        prompts -> [Sample]                     rollout engine
    score           [Sample] -> [Sample] with rewards        reward workers
    gather          this rank's samples -> every rank's       torch.distributed (no-op on one rank)
    make_batch      [Sample] -> PackedBatch with advantages  algo/ + batching/
    attach_logprobs old / ref log-probs when the loss needs them
    train           PackedBatch -> optimizer steps + metrics engine
    sync_weights    trainer weights -> rollout engine, version + 1

`learn` is the trainer half of a step, the same in every loop: make_batch -> attach_logprobs ->
train -> sync_weights -> the step's metrics. A loop decides only how the samples come (the order
and overlap of the rollout-side calls); the stages never branch on the loop or on the backend.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

from slipstream.batching.packing import pack_samples, select
from slipstream.batching.planner import quadratic_scale_for, split_minibatches
from slipstream.batching.records import PackedBatch, Sample
from slipstream.batching.shard import local_micro_batches
from slipstream.config.schema import Config
from slipstream.controller.prompts import TokenizedPrompt
from slipstream.engine.base import MAX_METRIC_SUFFIX, OutOfMemory, TrainEngine
from slipstream.engine.distributed import all_reduce_, data_parallel_group, gather_per_token
from slipstream.models.config import ModelConfig
from slipstream.perf.timers import PhaseTimer, perf_metrics
from slipstream.rewards.runner import RewardRunner
from slipstream.rollout.base import RolloutEngine, SamplingParams


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class Stages:
    """The components of a run and the stage functions over them."""

    cfg: Config
    model_cfg: ModelConfig
    tokenizer: object
    engine: TrainEngine
    ref: TrainEngine | None
    rollout: RolloutEngine
    sampling: SamplingParams
    rewards: RewardRunner
    advantage_fn: object
    loss_fn: object
    world: int
    peak_flops: float | None
    decoupled: bool = False
    """Decoupled PPO: old log-probs (the proximal policy) are recomputed before every update."""
    sample_budgets: list[int] | None = None
    """max_new_tokens of each sample of a step, in group order (benchmarks with mixed lengths); None: rollout.max_new_tokens."""

    @property
    def dp_rank(self) -> int:
        return self.engine.dp_rank

    @property
    def dp_size(self) -> int:
        return self.engine.dp_size

    # ------------------------------------------------------------------ rollout side
    def my_share(self, records: list[TokenizedPrompt]) -> tuple[int, list[TokenizedPrompt]]:
        """(first group id, records) of this data-parallel rank: each rank generates whole groups."""
        first = self.dp_rank * len(records) // self.dp_size
        return first, records[first : first + len(records) // self.dp_size]

    def generate(self, records: list[TokenizedPrompt], first_group: int) -> list[Sample]:
        """`group_size` samples per prompt, group ids numbered from `first_group`."""
        budgets = self.budgets_for([first_group + g for g in range(len(records))])
        return generate_groups(self.rollout, self.sampling, records, first_group, budgets)

    def budgets_for(self, group_ids: list[int]) -> list[list[int]] | None:
        """Per-sample budgets of these groups when the step has mixed lengths (sample_budgets), else None."""
        if self.sample_budgets is None:
            return None
        n = self.sampling.n
        return [self.sample_budgets[g * n : (g + 1) * n] for g in group_ids]


    def score(self, samples: list[Sample]) -> list[Sample]:
        return score_samples(self.tokenizer, self.rewards, samples)

    def gather(self, samples: list[Sample]) -> list[Sample]:
        """Every rank's scored samples on every rank, in group order (the one-process order)."""
        if self.world == 1:
            return samples
        gathered: list = [None] * self.world
        torch.distributed.all_gather_object(gathered, samples, group=data_parallel_group())
        return sorted((s for part in gathered for s in part), key=lambda s: s.group_id)

    def sync_weights(self, version: int, into=None) -> None:
        """Copy the trainer's weights into the rollout engine (waking it); later tokens carry `version`.
        `into`: what takes them instead of the rollout engine (the async loop's producer, which holds
        the engine between two of its steps)."""
        (into or self.rollout).update_weights(self.engine.export_weights(), version=version)

    def release_rollout(self) -> None:
        """Colocated: free the rollout's KV cache and weights while the trainer works (rollout.sleep_during_train)."""
        if self.cfg.rollout.sleep_during_train:
            self.rollout.sleep()

    # ------------------------------------------------------------------ trainer side
    def learn(
        self, samples: list[Sample], step_num: int, timer: PhaseTimer, *, fresh_version: int | None = None,
        sync_into=None,
    ) -> dict[str, float]:  # fmt: skip
        """The trainer half of step `step_num`, the same in every loop: advantages and the packed batch,
        old / ref log-probs, the optimizer steps, the weight sync to version step_num + 1 (into the
        rollout engine, or `sync_into`), then the step's metrics (training, samples, perf).

        The loop opened `timer`'s "step" phase for its rollout half; this half enters it again (a
        phase's time adds up over its entries), so perf/step_time covers the whole step."""
        with timer.phase("step"):
            batch, rewards = self.make_batch(samples, fresh_version=fresh_version)
            batch = self.attach_logprobs(batch, timer)
            with timer.phase("actor_train"):
                metrics = self.train(batch, step_num)
            with timer.phase("update_weights"):
                self.sync_weights(step_num + 1, into=sync_into)
        return {**metrics, **self.sample_metrics(samples, rewards), **self.perf(batch, samples, timer)}

    def make_batch(self, samples: list[Sample], fresh_version: int | None = None) -> tuple[PackedBatch, torch.Tensor]:
        """Group-normalised advantages and the packed batch; also returns the rewards (n,).

        `fresh_version`: the trainer's version, when some tokens may be older (async): the batch then
        marks the tokens sampled by exactly that version (for the rollout-mismatch metrics)."""
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        group_ids = torch.tensor([s.group_id for s in samples])
        seq_adv = self.advantage_fn(rewards, group_ids)
        batch = pack_samples(samples, seq_adv, indices=list(range(len(samples))), fresh_version=fresh_version)
        return batch, rewards

    def micro_batches(self, batch: PackedBatch) -> tuple[list[PackedBatch], list[tuple[int, ...]]]:
        """This rank's token-budget micro-batches (and their sequence ids) of a plan balanced over the
        data-parallel ranks by estimated work (linear + attention term of this model)."""
        return local_micro_batches(
            batch, self.cfg.actor.max_tokens_per_mb, planner=self.cfg.actor.planner,
            rank=self.dp_rank, world=self.dp_size, quadratic_scale=quadratic_scale_for(self.model_cfg),
        )  # fmt: skip

    def attach_logprobs(self, batch: PackedBatch, timer: PhaseTimer) -> PackedBatch:
        """Old log-probs when the batch is used for more than one update or the loss is decoupled (the
        proximal policy); ref log-probs for the KL term."""
        recompute = self.cfg.algo.ppo_n_minibatches * self.cfg.algo.ppo_epochs > 1 or self.decoupled
        mbs, ids = self.micro_batches(batch) if (recompute or self.ref is not None) else ([], [])
        if recompute:
            with timer.phase("old_log_probs"):
                outs = self.engine.forward_logprobs(mbs)
                batch = batch.with_(old_logprobs=gather_per_token([o.logprobs.cpu() for o in outs], ids, batch))
        if self.ref is not None:
            with timer.phase("ref_log_probs"):
                outs = self.ref.forward_logprobs(mbs)
                batch = batch.with_(ref_logprobs=gather_per_token([o.logprobs.cpu() for o in outs], ids, batch))
        return batch

    def train(self, batch: PackedBatch, step_num: int) -> dict[str, float]:
        """ppo_epochs x ppo_n_minibatches optimizer steps on `batch`; metrics averaged over them."""
        cfg = self.cfg
        sums: dict[str, float] = {}
        mismatch: dict[str, float] = {}
        count = 0
        for epoch in range(cfg.algo.ppo_epochs):
            # With several minibatches, each epoch visits the groups in a fresh order. The generator is
            # seeded from (seed, step, epoch), so a resumed run shuffles exactly as the original did.
            shuffle = None
            if cfg.algo.ppo_n_minibatches > 1:
                shuffle = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step_num * 1_009 + epoch)
            minibatches = split_minibatches(batch.num_seqs, cfg.algo.ppo_n_minibatches, cfg.rollout.group_size,
                                            generator=shuffle)  # fmt: skip
            for seq_ids in minibatches:
                mbs, _ = self.micro_batches(select(batch, seq_ids))
                metrics = self.engine.forward_backward(mbs, self.loss_fn, max_response_len=cfg.rollout.max_new_tokens)
                metrics.update(self.engine.optim_step())
                if cfg.trainer.stop_on_nan and not all(map(math.isfinite, metrics.values())):
                    raise NonFiniteLoss(f"non-finite training metrics: {metrics}")
                for key in [k for k in metrics if k.startswith("rollout/")]:
                    value = metrics.pop(key)
                    if epoch == 0:  # every token once, compared with the pre-update weights
                        merge = max if key.endswith(MAX_METRIC_SUFFIX) else (lambda a, b: a + b)
                        mismatch[key] = merge(mismatch[key], value) if key in mismatch else value
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
        return {**{key: value / count for key, value in sums.items()}, **_mismatch_metrics(mismatch)}

    # ------------------------------------------------------------------ metrics
    def sample_metrics(self, samples: list[Sample], rewards: torch.Tensor) -> dict[str, float]:
        resp = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
        # unweighted score of each reward function (CombinedReward puts them in reward_info)
        per_fn: dict[str, list[float]] = {}
        for s in samples:
            for name, value in s.reward_info.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    per_fn.setdefault(name, []).append(float(value))
        group = rewards.view(-1, self.cfg.rollout.group_size)
        versions = torch.tensor([s.version for s in samples], dtype=torch.float32)
        # per reward function: which share of the completions it raised / timed out on (RewardRunner's info)
        failures = [s.reward_info.get("failures", {}) for s in samples]
        for name in self.rewards.names:
            for kind in ("error", "timeout"):
                per_fn[f"{name}/{kind}_frac"] = [float(f.get(name) == kind) for f in failures]
        return {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "reward/max": float(rewards.max()),
            "reward/zero_adv_group_frac": float((group.min(dim=1).values == group.max(dim=1).values).float().mean()),
            "reward/error_frac": sum("error" in s.reward_info for s in samples) / len(samples),
            "rollout/response_len_mean": float(resp.mean()),
            "rollout/response_len_max": float(resp.max()),
            "rollout/stop_frac": sum(s.finish_reason == "stop" for s in samples) / len(samples),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout/policy_version": float(versions.min()),
            **{f"reward/{name}": sum(v) / len(v) for name, v in per_fn.items() if len(v) == len(samples)},
        }

    def staleness_metrics(self, samples: list[Sample], trainer_version: int) -> dict[str, float]:
        """How many versions behind the trainer the trained response tokens were sampled."""
        lags = [trainer_version - v for s in samples for v in (s.token_versions or (s.version,) * len(s.response_ids))]
        if not lags:
            return {}
        return {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))}

    def perf(self, batch: PackedBatch, samples: list[Sample], timer: PhaseTimer) -> dict[str, float]:
        """Phase times, per-phase memory and the throughput metrics (docs/architecture.md#metrics) of one step."""
        metrics = {"perf/num_dp_ranks": float(self.dp_size), **timer.summary()}
        metrics.update(
            perf_metrics(
                self.model_cfg,
                seq_lens=batch.seq_lens(),
                response_lens=[len(s.response_ids) for s in samples],
                times=self._slowest_rollout(timer.times),
                train_passes=self.cfg.algo.ppo_epochs,
                world_size=self.world,
                peak_flops=self.peak_flops,
            )
        )
        return metrics

    def _slowest_rollout(self, times: dict[str, float]) -> dict[str, float]:
        """Phase times for the throughput metrics: with several ranks the rollout phase is the slowest rank's
        (the others wait for it in gather_samples), so rollout tokens/s per GPU is not overstated."""
        if "rollout" in times:  # (all_reduce_ is a no-op in one process)
            slowest = all_reduce_(torch.tensor([times["rollout"]], dtype=torch.float64), op=torch.distributed.ReduceOp.MAX)
            times = {**times, "rollout": float(slowest[0])}
        return times


def generate_groups(
    rollout: RolloutEngine, sampling: SamplingParams, records: list[TokenizedPrompt], first_group: int,
    budgets: list[list[int]] | None = None,
) -> list[Sample]:  # fmt: skip
    """`sampling.n` samples of each prompt, keyed by its data-stream position; group ids from `first_group`."""
    groups = rollout.generate([r.prompt_ids for r in records], sampling, keys=[r.index for r in records], budgets=budgets)
    return [s for g, (r, group) in enumerate(zip(records, groups)) for s in label_group(group, first_group + g, r)]


def label_group(samples: list[Sample], group_id: int, record: TokenizedPrompt) -> list[Sample]:
    """A group's samples with their group id, data-stream position, prompt text and ground truth."""
    return [
        replace(s, group_id=group_id, prompt_index=record.index, prompt_text=record.prompt_text, answer=record.answer)
        for s in samples
    ]


def score_samples(tokenizer, rewards: RewardRunner, samples: list[Sample]) -> list[Sample]:
    """Decode the responses and score them in the reward workers."""
    texts = tokenizer.batch_decode([list(s.response_ids) for s in samples], skip_special_tokens=True)
    scored = rewards.score([(t, s.answer, s.prompt_text) for t, s in zip(texts, samples)])
    return [
        replace(s, response_text=t, reward=float(r), reward_info=info) for s, t, (r, info) in zip(samples, texts, scored)
    ]


def _mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Trainer-vs-rollout log-prob mismatch of the step's fresh response tokens (see algo.losses.rollout_mismatch)."""
    tokens = sums.get("rollout/mismatch_tokens", 0.0)
    if not tokens:
        return {}
    return {
        "rollout/logprob_abs_diff_mean": sums["rollout/mismatch_abs_sum"] / tokens,
        "rollout/logprob_abs_diff_max": sums["rollout/logprob_abs_diff_max"],
        "rollout/behav_kl_k3": sums["rollout/mismatch_k3_sum"] / tokens,
    }


@contextlib.contextmanager
def rollout_oom_advice(cfg: Config):
    """Turn an OOM during generation into an error naming the settings that size the KV cache."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        raise OutOfMemory(
            f"out of memory while generating: lower rollout.gpu_memory_fraction (now {cfg.rollout.gpu_memory_fraction}), "
            f"rollout.max_batch_size (now {cfg.rollout.max_batch_size}), rollout.prefill_tokens (now "
            f"{cfg.rollout.prefill_tokens}) or rollout.max_new_tokens (now {cfg.rollout.max_new_tokens}). "
            f"Original error: {err}"
        ) from err
