"""Prompt stream of a run: dataset or procedural task -> rendered text -> token ids."""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.config.schema import Config
from slipstream.data.dataset import PromptDataset
from slipstream.data.formatting import render_prompt
from slipstream.data.sources import load_prompts
from slipstream.data.tasks import get_task
from slipstream.models.tokenizer import encode_prompt


@dataclass(frozen=True)
class TokenizedPrompt:
    prompt_ids: list[int]
    prompt_text: str
    answer: str | None
    index: int = 0
    """Position in the data stream: the key of the prompt's sampling randomness (same on every rank, across resumes)."""


class PromptSource:
    """Hands out `rollout.prompts_per_step` tokenized prompts per step and resumes exactly."""

    def __init__(self, cfg: Config, tokenizer) -> None:
        data = cfg.data
        self.tokenizer = tokenizer
        self.template = data.prompt_template
        self.use_chat_template = cfg.model.use_chat_template
        self.batch_size = cfg.rollout.prompts_per_step
        self.task = None
        if data.source.startswith("task:"):
            self.task = get_task(data.source.removeprefix("task:"), **data.task_params)
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
        start = self.dataset.position
        records = next(self.dataset.batches(self.batch_size))
        out = []
        for index, record in enumerate(records, start):
            rendered = render_prompt(record, self.template)
            ids = encode_prompt(self.tokenizer, rendered, use_chat_template=self.use_chat_template)
            text = rendered if isinstance(rendered, str) else self.tokenizer.decode(ids)
            out.append(TokenizedPrompt(prompt_ids=list(ids), prompt_text=text, answer=record.answer, index=index))
        return out

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)
