"""Where the answer sits in a completion, shared by every reward that reads one.

`extract_answer(completion, how)` with `how` (config: `reward.extract`):

    tag        the content of the last <answer>...</answer>
    boxed      the content of the last \\boxed{...} (nested braces allowed)
    last_line  the last non-empty line
    last_number the last number (for numeric answers: scores the result, not the phrasing)
    auto       tag, else boxed, else the last line

The math reward then reads a number from that span, countdown an expression, and the
reasoning-gym reward hands the span to the dataset's own `score_answer`.
"""

from __future__ import annotations

import re

EXTRACT_MODES = ("auto", "tag", "boxed", "last_line", "last_number")

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", flags=re.DOTALL)
# A number as written in prose: a fraction "3/4", a thousands-grouped "1,234.5", or a plain
# "-12", "0.5", ".5". Alternation order matters: the longest forms must be tried first.
_NUMBER_RE = re.compile(
    r"-?\d+(?:\.\d+)?\s*/\s*-?\d+(?:\.\d+)?"  # fraction
    r"|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?"  # 1,234,567.89
    r"|-?(?:\d+(?:\.\d*)?|\.\d+)"  # plain int / decimal
)


def extract_last_number(text: str) -> str | None:
    """The last number in `text` (fractions, decimals, thousands commas, negatives), or None.

    A trailing "." is the sentence's full stop, not part of the number ("is 43." -> "43").
    """
    matches = _NUMBER_RE.findall(text.replace("\u2212", "-"))
    return matches[-1].rstrip(".") if matches else None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i = start + len("\\boxed{")
        depth = 1
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i:j]
        # Unbalanced (e.g. the completion was cut off inside the box): try an earlier box.
        start = text.rfind("\\boxed{", 0, start)
    return None


def extract_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>, or None."""
    tags = _ANSWER_TAG_RE.findall(text)
    return tags[-1] if tags else None


def last_line(text: str) -> str | None:
    """The last line with anything but whitespace on it, stripped; None for a blank text."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def extract_answer(completion: str, how: str = "auto") -> str | None:
    """The answer span of `completion` (see the module docstring), stripped; None when there is none."""
    if how not in EXTRACT_MODES:
        raise ValueError(f"answer extraction must be one of {', '.join(EXTRACT_MODES)}, got {how!r}")
    if how == "tag":
        span = extract_tag(completion)
    elif how == "boxed":
        span = extract_boxed(completion)
    elif how == "last_line":
        span = last_line(completion)
    elif how == "last_number":
        span = extract_last_number(completion)
    else:
        span = extract_tag(completion)
        if span is None:
            span = extract_boxed(completion)
        if span is None:
            span = last_line(completion)
    return None if span is None else span.strip()
