"""Identity of a problem by its prompt text, so eval problems can be kept out of the training stream."""

from __future__ import annotations

import hashlib
import json


def prompt_hash(prompt: str | list[dict]) -> str:
    """A stable hash of a record's prompt before any template (text, or chat messages as JSON)."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]
