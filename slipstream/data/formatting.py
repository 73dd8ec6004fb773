"""Turn a PromptRecord into model input (templated text, or chat messages left for the tokenizer), and its length limit."""

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


def prompt_token_limit(max_prompt_length: int | None, max_context: int | None, max_new_tokens: int) -> tuple[int | None, str]:
    """The most tokens a prompt may have (None: no limit), and the setting that decides it, for messages.

    A prompt must leave room for `max_new_tokens` in the model's context (`max_context`,
    max_position_embeddings): a longer one cannot be generated from at all, so it is dropped like
    one over data.max_prompt_length rather than failing the run when it is sampled.
    """
    limits = []
    if max_prompt_length is not None:
        limits.append((max_prompt_length, f"data.max_prompt_length={max_prompt_length}"))
    if max_context is not None:
        limits.append((max_context - max_new_tokens,
                       f"the model's context {max_context} less max_new_tokens {max_new_tokens}"))  # fmt: skip
    if not limits:
        return None, ""
    return min(limits)
