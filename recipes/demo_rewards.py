"""Custom reward used by recipes/demo.yaml (referenced as "recipes/demo_rewards.py:is_digit").

A from-scratch model first has to discover that answers are digits; a small bonus for any
single digit gives GRPO a learning signal from the first step (chance is 10/96 instead of 1/96).
"""


def is_digit(completion: str, answer: str | None, prompt: str) -> float:
    return 1.0 if len(completion.strip()) == 1 and completion.strip().isdigit() else 0.0
