"""The `rg` reward: a reasoning-gym dataset scores the answer with its own `score_answer(answer, entry)`.

The ground truth is the JSON that data/reasoning_gym.py writes for each prompt (dataset name,
parameters and the generated entry); the dataset is rebuilt once per worker process.
"""

from __future__ import annotations

import json

from slipstream.data.reasoning_gym import create_dataset
from slipstream.rewards.extract import extract_answer


def rg_reward(completion: str, answer: str | None, prompt: str = "", extract: str = "auto") -> float:
    """The dataset's `score_answer` of the answer span of `completion` (in [0, 1]; partial credit is the dataset's)."""
    if answer is None:
        raise ValueError("the 'rg' reward needs the reasoning-gym entry of the prompt (data.source rg:...), got None")
    spec = json.loads(answer)
    dataset = create_dataset(spec["dataset"], spec["params"], size=1)
    predicted = extract_answer(completion, extract)
    try:
        return float(dataset.score_answer(predicted, spec["entry"]))
    except Exception:  # noqa: BLE001 - some scorers raise on an answer they cannot parse
        # (prime_factorization on "abc", ...): that answer is wrong, not a failed reward
        return 0.0
