"""reasoning-gym datasets as procedural tasks: `data.source: rg:<dataset>` or `rg:mix:<a>=<w>,<b>=<w>`.

reasoning-gym (PyPI `reasoning-gym`, the optional extra `.[tasks]`) generates problems from a
seed and scores answers with each dataset's own `score_answer(answer, entry)`. Here a dataset
becomes a `Task` like the built-in ones: stream position p draws `rng = Random(f"{seed}:{p}")`
(see data/dataset.py), picks a dataset of the mix by weight and an item index from that rng,
and the dataset generates item `index` (its own generators are seeded by `seed + index`). So the
stream is seeded and resumable exactly as the built-in tasks are.

Each prompt carries its dataset entry (question, answer, metadata) as the JSON text of the
record's `answer`, with the dataset's name and parameters: the `rg` reward
(rewards/reasoning_gym.py, which also builds the datasets for this module) rebuilds the dataset
in its worker process and calls its `score_answer` on the extracted answer.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from slipstream.data.sources import PromptRecord
from slipstream.rewards.reasoning_gym import create_dataset, encode_entry

# Item indices are drawn from [0, INDEX_RANGE); a dataset's item i is seeded by its seed + i.
INDEX_RANGE = 2**31 - 1


def parse_rg_source(source: str, params: dict) -> list[tuple[str, float, dict]]:
    """(dataset, weight, parameters) of each dataset of an `rg:` source.

    `rg:<name>` takes `params` (data.task_params) as the dataset's parameters; `rg:mix:<a>=2,<b>`
    takes per-dataset parameters keyed by name ({a: {...}, b: {...}}) and weights after '='
    (default 1).
    """
    body = source.removeprefix("rg:")
    if not body.startswith("mix:"):
        if not body or "," in body or "=" in body:
            raise ValueError(f"data source {source!r}: expected rg:<dataset> or rg:mix:<a>=<weight>,<b>=<weight>")
        return [(body, 1.0, dict(params))]
    parts = []
    for item in body.removeprefix("mix:").split(","):
        name, _, weight = item.strip().partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"data source {source!r}: weight of {name!r} must be a number, got {weight!r}") from None
        if not name or w <= 0:
            raise ValueError(f"data source {source!r}: each entry is <dataset> or <dataset>=<weight > 0>")
        parts.append((name, w, dict(params.get(name) or {})))
    names = [name for name, _, _ in parts]
    if len(set(names)) != len(names):
        raise ValueError(f"data source {source!r} names a dataset twice")
    stray = sorted(set(params) - set(names))
    if stray:
        raise ValueError(
            f"data.task_params of {source!r} are keyed by dataset name ({', '.join(names)}); {stray} is not in the mix"
        )
    return parts


@dataclass(frozen=True)
class RGTask:
    """A reasoning-gym dataset or a weighted mix of them, as a procedural `Task` (reward "rg")."""

    source: str
    params: dict = dataclasses.field(default_factory=dict)
    reward: str = "rg"

    def __post_init__(self) -> None:
        parts = parse_rg_source(self.source, self.params)
        for name, _, params in parts:
            create_dataset(name, params, INDEX_RANGE)  # fail now on bad names or parameters, not mid-run
        object.__setattr__(self, "_parts", parts)

    @property
    def name(self) -> str:
        return self.source

    def sample(self, rng: random.Random) -> PromptRecord:
        parts = self._parts  # type: ignore[attr-defined]
        if len(parts) == 1:
            name, _, params = parts[0]
        else:
            name, _, params = rng.choices(parts, weights=[w for _, w, _ in parts])[0]
        index = rng.randrange(INDEX_RANGE)
        entry = create_dataset(name, params, INDEX_RANGE)[index]
        return PromptRecord(
            prompt=entry["question"],
            answer=encode_entry(name, params, entry),
            meta={"task": f"rg:{name}", "index": index},
        )
