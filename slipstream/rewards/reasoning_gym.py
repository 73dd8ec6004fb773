"""The `rg` reward: a reasoning-gym dataset scores the answer with its own `score_answer(answer, entry)`.

The ground truth is the JSON of `encode_entry`, which data/reasoning_gym.py writes for each prompt
(dataset name, parameters and the generated entry); the dataset is rebuilt once per worker process.
The datasets are built here, below the data sources, for both sides.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json

from slipstream.rewards.extract import extract_answer

INSTALL_HINT = 'pip install -e ".[tasks]" (or pip install reasoning-gym)'


def import_reasoning_gym():
    """The reasoning_gym module, or a ValueError of one line naming the extra to install."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"reasoning-gym datasets (rg:...) need the reasoning-gym package: {INSTALL_HINT}") from None
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _create(name: str, params_json: str, size: int):
    rg = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown reasoning-gym dataset {name!r}{hint} ({len(DATASETS)} datasets, e.g. chain_sum, leg_counting)")
    params = json.loads(params_json)
    config_cls = DATASETS[name][1]
    allowed = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"reasoning-gym dataset {name!r} has no parameter(s) {unknown}; it takes {allowed}")
    try:
        return rg.create_dataset(name, seed=0, size=size, **params)
    except AssertionError as err:  # reasoning-gym validates its configs with assert
        raise ValueError(f"reasoning-gym dataset {name!r}, parameters {params}: {err}") from None


def create_dataset(name: str, params: dict, size: int):
    """The reasoning-gym dataset `name` with `params` and `size` items (cached per process); ValueError for
    bad names / params."""
    return _create(name, json.dumps(params, sort_keys=True), size)


def encode_entry(name: str, params: dict, entry: dict) -> str:
    """The ground-truth text a prompt carries to the `rg` reward: JSON of dataset, params and entry."""
    try:
        return json.dumps({"dataset": name, "params": params, "entry": entry})
    except TypeError as err:
        raise ValueError(f"reasoning-gym dataset {name!r}: its entries are not JSON-serialisable ({err})") from None


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
