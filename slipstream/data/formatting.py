"""Turn a PromptRecord into model input: templated text, or chat messages left for the tokenizer."""

from __future__ import annotations

import logging

from slipstream.data.sources import PromptRecord

logger = logging.getLogger(__name__)

_warned_chat_template = False


def render_prompt(record: PromptRecord, template: str | None = None) -> str | list[dict]:
    """Text prompts: `template` with "{prompt}" replaced (or the prompt as is); chat prompts: the messages.

    Only "{prompt}" is substituted (no str.format), so templates may contain literal braces such as
    "\\boxed{}". Chat messages are returned unchanged (a copy); the tokenizer's chat template is
    applied later by `slipstream.models.tokenizer.encode_prompt`, and `template` is ignored for them.
    """
    if template is not None and "{prompt}" not in template:
        raise ValueError(f"prompt template must contain '{{prompt}}', got {template!r}")
    if isinstance(record.prompt, str):
        return record.prompt if template is None else template.replace("{prompt}", record.prompt)
    if template is not None:
        global _warned_chat_template
        if not _warned_chat_template:
            logger.warning("prompt template is ignored for chat-message prompts (the chat template applies)")
            _warned_chat_template = True
    return [dict(m) for m in record.prompt]
