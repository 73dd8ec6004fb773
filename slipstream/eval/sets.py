"""Eval sets: fixed lists of tokenized problems built from any data source, and the held-out hashes.

A procedural source (task:..., rg:...) draws problem i from `Random(f"eval:{seed}:{i}")`, a seed
range the training stream (`Random(f"{shuffle_seed}:{position}")`) never uses; a file source
takes `size` rows in a seeded order. Problems are distinct by prompt text. Every problem's hash
is kept out of the training stream (controller/prompts.py), since small problem spaces collide
across seeds anyway. When the set's source is the training source and it has fewer distinct
problems than `size` (the demo's ten one-term sums), the set covers the whole space: it cannot
be held out, nothing is excluded, and the set says so (`held_out=False`). Problems too long to
generate from (data.max_prompt_length, or the model's context less the eval's max_new_tokens)
are dropped, named in a warning and counted (`eval/<set>/filtered_prompts`), as in training.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from slipstream.config.schema import Config, EvalSetSection
from slipstream.data.formatting import prompt_token_limit, render_prompt
from slipstream.data.heldout import prompt_hash
from slipstream.data.sources import PromptRecord, load_prompts
from slipstream.data.tasks import is_procedural, make_task
from slipstream.models.tokenizer import encode_prompt

log = logging.getLogger(__name__)

# A procedural set stops drawing after this many draws per wanted problem (its space is then
# taken to be exhausted: at most a few of its problems would still be missing).
_DRAWS_PER_PROBLEM = 20


@dataclass(frozen=True)
class EvalProblem:
    index: int
    prompt_ids: list[int]
    prompt_text: str
    answer: str | None


@dataclass(frozen=True)
class EvalSet:
    name: str
    problems: list[EvalProblem]
    rewards: list[str]
    """Reward specs whose (unweighted) sum decides correctness."""
    extract: str
    """Where those rewards read the answer (reward.extract unless the set says otherwise)."""
    hashes: frozenset[str]
    """Prompt hashes of the problems (before templates)."""
    held_out: bool
    """False when the set covers its whole (training) problem space: then nothing is excluded."""
    covers_space: bool
    """Fewer distinct problems exist than eval.sets.<name>.size asked for."""
    num_filtered: int = 0
    """Problems drawn but dropped for a prompt too long to generate from."""


def draw_records(source: str, params: dict, size: int, seed: int, data_cfg) -> tuple[list[PromptRecord], bool]:
    """Up to `size` distinct records of a source and whether that is all it has (fewer than `size`)."""
    if is_procedural(source):
        task = make_task(source, params)
        found: dict[str, PromptRecord] = {}
        for i in range(_DRAWS_PER_PROBLEM * size):
            record = task.sample(random.Random(f"eval:{seed}:{i}"))
            found.setdefault(prompt_hash(record.prompt), record)
            if len(found) == size:
                return list(found.values()), False
        return list(found.values()), True
    records = load_prompts(source, prompt_key=data_cfg.prompt_key, answer_key=data_cfg.answer_key,
                           on_error=data_cfg.on_error, split=data_cfg.split)  # fmt: skip
    unique = list({prompt_hash(r.prompt): r for r in records}.values())
    random.Random(f"eval:{seed}").shuffle(unique)
    return unique[:size], len(unique) <= size


def default_reward(source: str, params: dict) -> str:
    """The source's own reward: a procedural task's, else math."""
    return make_task(source, params).reward if is_procedural(source) else "math"


def build_eval_set(name: str, spec: EvalSetSection, cfg: Config, tokenizer, max_context: int | None = None) -> EvalSet:
    """The set's problems, tokenized; `max_context` (the model's max_position_embeddings) bounds their length."""
    source = cfg.data.source if spec.source is None else spec.source
    params = spec.task_params if spec.task_params is not None else (cfg.data.task_params if source == cfg.data.source else {})
    same_as_training = source == cfg.data.source and params == cfg.data.task_params
    records, covers_space = draw_records(source, params, spec.size, spec.seed, cfg.data)
    template = spec.prompt_template if spec.prompt_template is not None else cfg.data.prompt_template
    limit, reason = prompt_token_limit(
        cfg.data.max_prompt_length, max_context, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    )
    problems, kept = [], []
    for i, record in enumerate(records):
        rendered = render_prompt(record, template)
        ids = encode_prompt(tokenizer, rendered, use_chat_template=cfg.model.use_chat_template)
        if limit is not None and len(ids) > limit:
            log.warning("eval set %r: skipping prompt %s: %d tokens, longer than %d (%s)",
                        name, record.where or f"{source} problem {i}", len(ids), limit, reason)  # fmt: skip
            continue
        text = rendered if isinstance(rendered, str) else tokenizer.decode(ids)
        problems.append(EvalProblem(index=len(problems), prompt_ids=list(ids), prompt_text=text, answer=record.answer))
        kept.append(record)
    if not problems:
        raise ValueError(f"eval set {name!r}: all {len(records)} prompts are longer than {limit} tokens ({reason})")
    held_out = not (covers_space and same_as_training)
    if not held_out:
        log.warning("eval set %r covers the whole problem space of %s (%d distinct problems, eval.sets.%s.size=%d): "
                    "it is not held out from training", name, source, len(records), name, spec.size)
    elif covers_space:
        log.info("eval set %r: %s has only %d distinct problems (size %d asked)", name, source, len(records), spec.size)
    return EvalSet(
        name=name, problems=problems, rewards=list(spec.reward) or [default_reward(source, params)],
        extract=spec.extract or cfg.reward.extract,
        hashes=frozenset(prompt_hash(r.prompt) for r in kept), held_out=held_out, covers_space=covers_space,
        num_filtered=len(records) - len(kept),
    )  # fmt: skip


def build_eval_sets(cfg: Config, tokenizer, max_context: int | None = None) -> list[EvalSet]:
    """The configured eval sets, in name order (`max_context`: the model's max_position_embeddings)."""
    return [build_eval_set(name, cfg.eval.sets[name], cfg, tokenizer, max_context) for name in sorted(cfg.eval.sets)]


def excluded_hashes(sets: list[EvalSet]) -> frozenset[str]:
    """Prompt hashes the training stream must skip: every problem of every held-out set."""
    return frozenset().union(*(s.hashes for s in sets if s.held_out))
