"""`Evaluator`: score the rollout engine's current policy on the eval sets, and the eval schedule.

An eval generates with the rollout engine (so it measures exactly the weights the next step
samples from: call it after a step's weight sync), greedy and / or n sampled completions per
problem, scores them with each set's reward in the reward workers, and returns eval/<set>/...
metrics plus `perf/eval_time`. It never touches the training stream: the prompts are the
sets' own, and the sampler state the training rollouts depend on is left as it was.

With several data-parallel ranks each rank evaluates every world-th problem and the results are
gathered, so every rank returns the same metrics.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch

from slipstream.config.schema import Config
from slipstream.engine.distributed import data_parallel_group
from slipstream.eval.metrics import Completion, ProblemResult, set_metrics
from slipstream.eval.sets import EvalSet
from slipstream.rewards.extract import extract_answer
from slipstream.rewards.registry import with_extract
from slipstream.rewards.runner import RewardRunner
from slipstream.rollout.base import RolloutEngine, SamplingParams

log = logging.getLogger(__name__)

# Eval requests are keyed far above any training stream position, per set and problem.
_EVAL_KEY_BASE = 1 << 48
_EXAMPLES = 8  # completions kept per set for `slipstream eval --show`


def eval_key(prompt_text: str) -> int:
    """The sampling key of an eval problem, a function of its prompt only: its samples do not depend on the
    batch, and the same problem in two sets (scored two ways) gets the same completions."""
    return _EVAL_KEY_BASE + int.from_bytes(hashlib.sha1(prompt_text.encode()).digest()[:5], "big")


def generate_keyed(rollout: RolloutEngine, prompts: list[list[int]], sampling: SamplingParams, keys: list[int]):
    """rollout.generate with per-request keys: an eval's samples depend on its problems only, and an eval
    never shifts the training samples (whose keys are their data-stream positions)."""
    return rollout.generate(prompts, sampling, keys=keys)


def normalize_answer(text: str | None) -> str | None:
    """Answers compared for majority voting: whitespace runs collapsed, lower case, no trailing '.'."""
    if text is None:
        return None
    text = " ".join(text.split()).lower().rstrip(".")
    return text or None


class EvalSchedule:
    """Which steps get an eval: 0 (before training, if asked), every `every` steps, and the last step.

    `last_step` is the newest step evaluated; it is saved in checkpoints, so a resumed run
    continues the schedule without repeating or skipping an eval.
    """

    def __init__(self, every: int, before_training: bool, total_steps: int) -> None:
        self.every, self.before_training, self.total_steps = every, before_training, total_steps
        self.last_step = -1

    def due(self, step: int) -> bool:
        if step <= self.last_step:
            return False
        if step == 0:
            return self.before_training
        return bool(self.every and step % self.every == 0) or step == self.total_steps

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])


@dataclass
class Evaluator:
    cfg: Config
    tokenizer: object
    rollout: RolloutEngine
    sets: list[EvalSet]
    stop_token_ids: list[int]
    runners: dict[tuple, RewardRunner]
    """Reward runner per (reward specs, extraction) (the training runner is reused where both match)."""
    rank: int = 0
    world: int = 1
    examples: dict[str, list[tuple[str, str, float]]] = field(default_factory=dict)
    """(prompt, completion, score) of the first few problems of each set in the last run (this rank's share)."""
    _generated: dict = field(default_factory=dict)
    """Completions of this run by (sampling, keys): sets that share problems generate them once."""

    @classmethod
    def build(cls, cfg: Config, tokenizer, rollout: RolloutEngine, sets: list[EvalSet], stop_token_ids: list[int],
              train_rewards: RewardRunner | None = None, train_functions: list[str] | None = None,
              rank: int = 0, world: int = 1) -> "Evaluator":  # fmt: skip
        """An evaluator whose sets share one reward runner per distinct reward list."""
        runners: dict[tuple, RewardRunner] = {}
        unweighted = not cfg.reward.weights or all(w == 1.0 for w in cfg.reward.weights)
        if train_rewards is not None and train_functions and unweighted:
            runners[(*train_functions, cfg.reward.extract)] = train_rewards
        for s in sets:
            key = (*s.rewards, s.extract)
            if key not in runners:
                runners[key] = RewardRunner(
                    [(with_extract(f, s.extract), 1.0) for f in s.rewards], num_workers=cfg.reward.num_workers,
                    timeout_s=cfg.reward.timeout_s, on_error="zero", error_score=0.0,
                )  # fmt: skip
        return cls(cfg, tokenizer, rollout, sets, stop_token_ids, runners, rank, world)

    def close(self, keep: RewardRunner | None = None) -> None:
        """Stop the reward runners this evaluator started (not `keep`, the training one)."""
        for runner in self.runners.values():
            if runner is not keep:
                runner.close()

    def sampling(self, greedy: bool) -> SamplingParams:
        ev, r = self.cfg.eval, self.cfg.rollout
        return SamplingParams(
            temperature=0.0 if greedy else (ev.temperature if ev.temperature is not None else r.temperature),
            top_p=1.0 if greedy else r.top_p, top_k=0 if greedy else r.top_k,
            max_new_tokens=ev.max_new_tokens or r.max_new_tokens, stop_token_ids=self.stop_token_ids,
            n=1 if greedy else ev.n,
        )  # fmt: skip

    def run(self) -> dict[str, float]:
        """eval/<set>/... of the rollout's current weights, and perf/eval_time (wall seconds, all sets)."""
        start = time.perf_counter()
        self._generated = {}
        metrics: dict[str, float] = {}
        for s in self.sets:
            results = self._gather(self._evaluate_share(s))
            metrics.update(set_metrics(s.name, results, self.cfg.eval.pass_k))
            metrics[f"eval/{s.name}/held_out"] = float(s.held_out)
            metrics[f"eval/{s.name}/filtered_prompts"] = float(s.num_filtered)
        if self.rollout.device.type == "cuda":
            torch.cuda.synchronize(self.rollout.device)
        metrics["perf/eval_time"] = time.perf_counter() - start
        self._generated = {}
        return metrics

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, keys: list[int]):
        cache_key = (sampling, tuple(keys))
        if cache_key not in self._generated:
            self._generated[cache_key] = generate_keyed(self.rollout, prompts, sampling, keys)
        return self._generated[cache_key]

    def _evaluate_share(self, s: EvalSet) -> list[ProblemResult]:
        mine = s.problems[self.rank :: self.world]
        if not mine:
            return []
        prompts = [p.prompt_ids for p in mine]
        keys = [eval_key(p.prompt_text) for p in mine]
        greedy: list[Completion | None] = [None] * len(mine)
        sampled: list[tuple[Completion, ...]] = [()] * len(mine)
        if self.cfg.eval.n > 0:
            groups = self._generate(prompts, self.sampling(greedy=False), keys)
            sampled = [tuple(c) for c in self._score(s, mine, groups)]
        if self.cfg.eval.greedy:  # last, so that the examples kept are greedy ones when there are any
            groups = self._generate(prompts, self.sampling(greedy=True), keys)
            greedy = [c[0] for c in self._score(s, mine, groups)]
        return [ProblemResult(index=p.index, greedy=g, samples=smp) for p, g, smp in zip(mine, greedy, sampled)]

    def _score(self, s: EvalSet, problems, groups) -> list[list[Completion]]:
        flat = [(p, sample) for p, group in zip(problems, groups) for sample in group]
        texts = self.tokenizer.batch_decode([list(smp.response_ids) for _, smp in flat], skip_special_tokens=True)
        scores = self.runners[(*s.rewards, s.extract)].score([(t, p.answer, p.prompt_text) for t, (p, _) in zip(texts, flat)])
        self.examples[s.name] = [(p.prompt_text, t, float(r)) for t, (p, _), (r, _) in list(zip(texts, flat, scores))[:_EXAMPLES]]
        threshold = self.cfg.eval.correct_threshold
        completions = [
            Completion(score=float(score), correct=float(score) >= threshold,
                       answer=normalize_answer(extract_answer(text, s.extract)),
                       response_len=len(smp.response_ids), truncated=smp.finish_reason == "length")
            for text, (_, smp), (score, _) in zip(texts, flat, scores)
        ]  # fmt: skip
        out, i = [], 0
        for group in groups:
            out.append(completions[i : i + len(group)])
            i += len(group)
        return out

    def _gather(self, results: list[ProblemResult]) -> list[ProblemResult]:
        if self.world == 1:
            return results
        gathered: list = [None] * self.world
        torch.distributed.all_gather_object(gathered, results, group=data_parallel_group())
        return sorted((r for part in gathered for r in part), key=lambda r: r.index)


def format_eval(step: int, metrics: dict[str, float], sets: list[EvalSet]) -> str:
    """One log line per set: `eval step 50 | add2 (200): accuracy 0.415 pass@8 0.83 ... | 3.1s`."""
    lines = []
    for s in sets:
        prefix = f"eval/{s.name}/"
        shown = " ".join(
            f"{key.removeprefix(prefix)} {value:.3f}" for key, value in metrics.items()
            if key.startswith(prefix) and key.removeprefix(prefix) not in ("num_problems", "held_out")
        )  # fmt: skip
        note = "" if s.held_out else ", not held out"
        lines.append(f"eval step {step} | {s.name} ({len(s.problems)} problems{note}): {shown}")
    lines[-1] += f" | {metrics.get('perf/eval_time', 0.0):.1f}s"
    return "\n".join(lines)
