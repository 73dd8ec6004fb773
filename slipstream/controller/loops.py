"""The RL loops: the order in which the stages of controller/stages.py run.

`SyncLoop`: generate -> score -> advantages -> train -> sync weights, one after the other; the
samples of step k come from policy version k (the weights after k optimizer-step rounds).

`AsyncLoop`: a producer thread (controller/producer.py) generates and scores the batches of
future steps, at most `trainer.max_staleness` versions ahead; each step the trainer takes the
step's batch, trains (decoupled PPO by default) and syncs the weights into the running engine.

Both report the wait on each side: `perf/wait_time_ratio` (the trainer's idle share of the step)
and `perf/rollout_wait_ratio` (the rollout engine's).
"""

from __future__ import annotations

import contextlib

from slipstream.controller.dynamic_sampling import DynamicSampling, SparePrompts
from slipstream.controller.producer import RolloutProducer
from slipstream.controller.prompts import PromptSource
from slipstream.controller.stages import Stages, rollout_oom_advice
from slipstream.perf.timers import PhaseTimer


class _StepwiseLoop:
    """A loop with nothing in flight between its steps: no state to save, nothing to stop, and the
    rollout engine idle for another user (an eval) whenever the loop is not inside step()."""

    def state_dict(self, next_step: int) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def paused(self):
        return contextlib.nullcontext()


class SyncLoop(_StepwiseLoop):
    """One synchronous RL step per call."""

    def __init__(self, stages: Stages, prompts: PromptSource) -> None:
        self.stages = stages
        self.prompts = prompts
        self.spares = SparePrompts(prompts)

    def step(self, step_num: int) -> dict[str, float]:
        """Train on fresh samples of policy `step_num`; the rollout ends holding version step_num + 1."""
        st = self.stages
        timer = PhaseTimer(st.engine.device)
        with timer.phase("step"):
            # every rank reads the same prompts and generates the groups of its share of them
            first, records = st.my_share(self.prompts.next_batch())
            with timer.phase("rollout"), rollout_oom_advice(st.cfg):
                samples = st.generate(records, first)
            with timer.phase("reward"):
                samples = st.score(samples)
            dynamic = {}
            if st.cfg.algo.dynamic_sampling:  # may generate again: the engine sleeps after it
                samples, dynamic = self._dynamic_sampling(samples, step_num, timer)
            with timer.phase("rollout"):
                st.release_rollout()
            if st.world > 1:
                with timer.phase("gather_samples"):
                    samples = st.gather(samples)
        metrics = st.learn(samples, step_num, timer)
        metrics["perf/rollout_wait_ratio"] = max(0.0, 1.0 - timer.times.get("rollout", 0.0) / timer.times["step"])
        return {**metrics, **dynamic}

    def _dynamic_sampling(self, samples: list, step_num: int, timer: PhaseTimer) -> tuple[list, dict]:
        """The groups with a learning signal (controller/dynamic_sampling.py); generates replacements."""
        st = self.stages
        kept, pending = [], _groups(samples)
        dynamic = DynamicSampling.for_step(st.cfg, step_num)
        while pending:
            replacements = []
            for group in pending:
                replacement = dynamic.admit(group, self.spares)
                if replacement is None:
                    kept.append(group)
                else:
                    replacements.append(replacement)
            pending = []
            if replacements:  # their ids are consecutive: one call generates them
                first = replacements[0][0]
                assert [gid for gid, _ in replacements] == list(range(first, first + len(replacements)))
                with timer.phase("rollout"), rollout_oom_advice(st.cfg):
                    more = st.generate([record for _, record in replacements], first)
                with timer.phase("reward"):
                    pending = _groups(st.score(more))
        kept.sort(key=lambda g: g[0].group_id)
        return [s for g in kept for s in g], dynamic.metrics()


class AsyncLoop:
    """One step of the trainer per call; the rollout runs ahead in a producer thread."""

    def __init__(self, stages: Stages, prompts: PromptSource) -> None:
        self.stages, self.prompts = stages, prompts
        self.max_staleness = stages.cfg.trainer.max_staleness
        self.producer: RolloutProducer | None = None
        self._resume_position: int | None = None
        self._starts: dict[int, int] = {}  # batch -> stream position of its first prompt, kept after close()

    def _start(self, step_num: int) -> None:
        if self._resume_position is not None:  # re-generate what was in flight at the checkpoint
            self.prompts.dataset.position = self._resume_position
        self.producer = RolloutProducer(
            self.stages, self.prompts, self.max_staleness, first_step=step_num,
            dynamic_sampling=self.stages.cfg.algo.dynamic_sampling,
        )  # fmt: skip
        self.producer.start()

    def step(self, step_num: int) -> dict[str, float]:
        """Train batch `step_num` (sampled by versions >= step_num - max_staleness); sync version step_num + 1."""
        st = self.stages
        if self.producer is None:
            self._start(step_num)
        timer = PhaseTimer(st.engine.device)
        with timer.phase("step"):
            with timer.phase("wait_rollout"):
                samples, produced = self.producer.take(step_num)
            if st.world > 1:
                with timer.phase("gather_samples"):
                    samples = st.gather(samples)
            samples, dropped = within_bound(samples, step_num, self.max_staleness)
        metrics = st.learn(samples, step_num, timer, fresh_version=step_num, sync_into=self.producer)
        idle = produced.pop("perf/rollout_idle_time")
        metrics["perf/rollout_wait_ratio"] = min(1.0, idle / timer.times["step"])
        return {
            **metrics, **produced, **st.staleness_metrics(samples, step_num), "async/dropped_stale": float(dropped),
        }  # fmt: skip

    def state_dict(self, next_step: int) -> dict:
        """Where the data stream resumes: at the first prompt of the next step's batch, so that what is in
        flight is generated again after a resume (nothing lost, nothing trained twice)."""
        starts = self.producer.starts if self.producer is not None else self._starts
        # None: the producer has not drawn that batch yet, so the stream position saved with the data is it
        return {"resume_position": starts.get(next_step)}

    def load_state_dict(self, state: dict) -> None:
        self._resume_position = state.get("resume_position")

    def paused(self):
        """The rollout engine, idle, for another user (an eval): the producer finishes what is in flight
        and starts nothing until the block ends."""
        return self.producer.paused() if self.producer is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()
            self._starts = dict(self.producer.starts)
            self.producer = None


def _groups(samples: list) -> list[list]:
    """Samples split into their groups (consecutive samples share a group id)."""
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return list(groups.values())


def within_bound(samples: list, step_num: int, max_staleness: int) -> tuple[list, int]:
    """Drop (and count) the groups holding a token sampled more than `max_staleness` versions before
    `step_num`. The admission rules keep this from happening; the check makes the bound a guarantee."""
    oldest: dict[int, int] = {}
    for s in samples:
        oldest[s.group_id] = min(oldest.get(s.group_id, s.version), s.version)
    stale = {g for g, v in oldest.items() if step_num - v > max_staleness}
    return [s for s in samples if s.group_id not in stale], len(stale)


class DisaggregatedLoop(_StepwiseLoop):
    """The trainer ranks' loop when other ranks generate (controller/placement.py): take the step's batch
    from the rollout ranks, train, broadcast the new weights."""

    def __init__(self, stages: Stages, max_staleness: int) -> None:
        self.stages = stages
        self.max_staleness = max_staleness

    def step(self, step_num: int) -> dict[str, float]:
        st = self.stages
        timer = PhaseTimer(st.engine.device)
        with timer.phase("step"):
            with timer.phase("wait_rollout"):
                samples = st.rollout.gather_batch()
            samples, dropped = within_bound(samples, step_num, self.max_staleness)
        metrics = st.learn(samples, step_num, timer, fresh_version=step_num)  # broadcasts to the rollout ranks
        metrics["perf/rollout_wait_ratio"] = st.rollout.wait_ratio  # the rollout ranks' own, sent with the batch
        return {**metrics, **st.staleness_metrics(samples, step_num), "async/dropped_stale": float(dropped)}

