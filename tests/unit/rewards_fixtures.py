"""Custom rewards for tests/unit/test_rewards.py: well-behaved, raising, hanging and crashing.

Loaded by the tests as "path/to/rewards_fixtures.py:function" so that spawned reward workers
can import it regardless of sys.path.
"""

from __future__ import annotations

import os
import time


def length_reward(completion: str, answer: str | None, prompt: str) -> float:
    """Length of the completion: easy to check by hand."""
    return float(len(completion))


def pid_reward(completion: str, answer: str | None, prompt: str) -> dict:
    """Score 1 and report which process computed it."""
    return {"score": 1.0, "pid": os.getpid()}


def misbehaving_reward(completion: str, answer: str | None, prompt: str) -> float:
    """Behaves according to the completion text: "raise", "hang", "exit", "nan", else its length."""
    if completion == "raise":
        raise ZeroDivisionError("deliberate failure in a reward")
    if completion == "hang":
        time.sleep(60)
    if completion == "exit":
        os._exit(3)
    if completion == "nan":
        return float("nan")
    return float(len(completion))


def always_raising_reward(completion: str, answer: str | None, prompt: str) -> float:
    """Raises on every call (used by the end-to-end failure test)."""
    raise RuntimeError("this reward always fails")


def char_code_reward(completion: str, answer: str | None, prompt: str) -> float:
    """A deterministic score in [0, 1) that varies between completions (for loop-equivalence tests)."""
    return float(sum(map(ord, completion)) % 7) / 7.0


def always_hanging_reward(completion: str, answer: str | None, prompt: str) -> float:
    """Hangs on every call (a reward stuck on a lock or a dead server)."""
    time.sleep(60)
    return 0.0


def slow_exact_reward(completion: str, answer: str | None, prompt: str) -> float:
    """The exact-match reward, 40 ms a call: steps long enough to interrupt in the middle."""
    from slipstream.rewards.functions import exact_reward

    time.sleep(0.04)
    return exact_reward(completion, answer, prompt)
