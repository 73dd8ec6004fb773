"""Prompt sources (jsonl, parquet, HF datasets on disk), procedural tasks (built in, reasoning-gym), resumable batching."""

from slipstream.data.dataset import PromptDataset
from slipstream.data.formatting import render_prompt
from slipstream.data.sources import PromptRecord, load_prompts
from slipstream.data.tasks import TASKS, get_task, is_procedural, make_task

__all__ = ["TASKS", "PromptDataset", "PromptRecord", "get_task", "is_procedural", "load_prompts", "make_task", "render_prompt"]
