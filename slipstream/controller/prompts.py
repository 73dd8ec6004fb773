"""Prompt stream of a run: dataset or procedural task -> rendered text -> token ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from slipstream.config.schema import Config
from slipstream.data.dataset import PromptDataset
from slipstream.data.formatting import prompt_token_limit, render_prompt
from slipstream.data.heldout import prompt_hash
from slipstream.data.sources import load_prompts
from slipstream.data.tasks import is_procedural, make_task
from slipstream.models.tokenizer import encode_prompt

log = logging.getLogger(__name__)

# Skipped prompts in a row (too long, or held out for eval) after which the stream gives up.
_MAX_CONSECUTIVE_SKIPS = 10_000
# Over-long prompts named in a warning each; later ones are only counted (data/filtered_prompts).
_NAMED_FILTERED = 5


@dataclass(frozen=True)
class TokenizedPrompt:
    prompt_ids: list[int]
    prompt_text: str
    answer: str | None
    index: int = 0
    """Position in the data stream: the key of the prompt's sampling randomness (same on every rank, across resumes)."""


class PromptSource:
    """Hands out `rollout.prompts_per_step` tokenized prompts per step and resumes exactly.

    Prompts whose hash is in `exclude` (the eval problems) and prompts longer than
    data.max_prompt_length tokens, or than the model's context (`max_context`) less
    rollout.max_new_tokens, are skipped and counted; the stream position counts them too, so a
    resumed run skips the same ones.
    """

    def __init__(
        self, cfg: Config, tokenizer, exclude: frozenset[str] = frozenset(), max_context: int | None = None
    ) -> None:
        data = cfg.data
        self.tokenizer = tokenizer
        self.template = data.prompt_template
        self.use_chat_template = cfg.model.use_chat_template
        self.batch_size = cfg.rollout.prompts_per_step
        self.exclude = exclude
        self.max_prompt_length, self.limit_reason = prompt_token_limit(
            data.max_prompt_length, max_context, cfg.rollout.max_new_tokens
        )
        """The most tokens of a prompt handed out (None: any), and the setting that decides it."""
        self.num_filtered = 0
        """Prompts dropped for being longer than max_prompt_length."""
        self.num_held_out = 0
        """Prompts skipped because they are eval problems."""
        self.task = None
        if is_procedural(data.source):
            self.task = make_task(data.source, data.task_params)
            self.dataset = PromptDataset(self.task, seed=data.shuffle_seed, epoch_size=data.num_task_prompts)
        else:
            records = load_prompts(
                data.source, prompt_key=data.prompt_key, answer_key=data.answer_key, on_error=data.on_error,
                split=data.split,
            )
            self.dataset = PromptDataset(records, seed=data.shuffle_seed)
        self._reward_functions = list(cfg.reward.functions) or [self.task.reward if self.task else "math"]

    def reward_functions(self) -> list[str]:
        """The configured rewards, or the task's own one when none are configured."""
        return self._reward_functions

    def next_batch(self) -> list[TokenizedPrompt]:
        out: list[TokenizedPrompt] = []
        skipped = 0
        while len(out) < self.batch_size:
            index = self.dataset.position
            record = self.dataset.record_at(index)
            self.dataset.position += 1
            if self.exclude and prompt_hash(record.prompt) in self.exclude:
                self.num_held_out += 1
                skipped += 1
            else:
                rendered = render_prompt(record, self.template)
                ids = encode_prompt(self.tokenizer, rendered, use_chat_template=self.use_chat_template)
                if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
                    self._warn_filtered(record, index, len(ids))
                    self.num_filtered += 1
                    skipped += 1
                else:
                    text = rendered if isinstance(rendered, str) else self.tokenizer.decode(ids)
                    out.append(TokenizedPrompt(prompt_ids=list(ids), prompt_text=text, answer=record.answer, index=index))
                    skipped = 0
            if skipped >= _MAX_CONSECUTIVE_SKIPS:
                raise ValueError(
                    f"{skipped} prompts in a row were skipped ({self.num_filtered} so far longer than "
                    f"{self.max_prompt_length} tokens ({self.limit_reason}), {self.num_held_out} held out as eval "
                    "problems): raise data.max_prompt_length or lower rollout.max_new_tokens, or make the eval sets "
                    "smaller than the task's problem space"
                )
        return out

    def _warn_filtered(self, record, index: int, num_tokens: int) -> None:
        if self.num_filtered < _NAMED_FILTERED:
            where = record.where or f"{self.task.name if self.task else 'data'} position {index}"
            more = "; later ones are only counted in data/filtered_prompts" if self.num_filtered == _NAMED_FILTERED - 1 else ""
            log.warning("skipping prompt %s: %d tokens, longer than %d (%s)%s",
                        where, num_tokens, self.max_prompt_length, self.limit_reason, more)  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """Counts of skipped prompts since the start of the run."""
        return {"data/filtered_prompts": float(self.num_filtered), "data/eval_prompts_skipped": float(self.num_held_out)}

    def state_dict(self) -> dict:
        return {**self.dataset.state_dict(), "num_filtered": self.num_filtered, "num_held_out": self.num_held_out}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)
        # absent from checkpoints written before the counters existed
        self.num_filtered = int(state.get("num_filtered", 0))
        self.num_held_out = int(state.get("num_held_out", 0))
