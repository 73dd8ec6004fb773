"""The RL loops: the order in which the stages of controller/stages.py run.

`SyncLoop`: generate -> score -> advantages -> train -> sync weights, one after the other; the
samples of step k come from policy version k (the weights after k optimizer-step rounds).
"""

from __future__ import annotations

from slipstream.controller.prompts import PromptSource
from slipstream.controller.stages import Stages, rollout_oom_advice
from slipstream.perf.timers import PhaseTimer


class SyncLoop:
    """One synchronous RL step per call."""

    def __init__(self, stages: Stages, prompts: PromptSource) -> None:
        self.stages = stages
        self.prompts = prompts

    def step(self, step_num: int) -> dict[str, float]:
        """Train on fresh samples of policy `step_num`; the rollout ends holding version step_num + 1."""
        st = self.stages
        timer = PhaseTimer(st.engine.device)
        with timer.phase("step"):
            # every rank reads the same prompts and generates the groups of its share of them
            first, records = st.my_share(self.prompts.next_batch())
            with timer.phase("rollout"), rollout_oom_advice(st.cfg):
                samples = st.generate(records, first)
                st.release_rollout()
            with timer.phase("reward"):
                samples = st.score(samples)
            if st.world > 1:
                with timer.phase("gather_samples"):
                    samples = st.gather(samples)
            batch, rewards = st.make_batch(samples)
            batch = st.attach_logprobs(batch, timer)
            with timer.phase("actor_train"):
                metrics = st.train(batch, step_num)
            with timer.phase("update_weights"):
                st.sync_weights(step_num + 1)
        return {**metrics, **st.sample_metrics(samples, rewards), **st.perf(batch, samples, timer)}

    def state_dict(self) -> dict:
        """Nothing is in flight between sync steps."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
