"""Prompt sources (jsonl, parquet, HF datasets on disk), procedural tasks, resumable batching."""

from slipstream.data.dataset import PromptDataset
from slipstream.data.formatting import render_prompt
from slipstream.data.sources import PromptRecord, load_prompts
from slipstream.data.tasks import TASKS, get_task

__all__ = ["TASKS", "PromptDataset", "PromptRecord", "get_task", "load_prompts", "render_prompt"]
