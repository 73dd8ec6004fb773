"""metrics.jsonl: one JSON object per logged step, the run's durable record of its metrics."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Mapping

RESERVED_KEYS = ("step", "time")


def _json_value(value: float) -> float | None:
    # JSON has no NaN / inf; null keeps the line valid for every reader (jq, pandas, browsers).
    return value if math.isfinite(value) else None


class JsonlSink:
    """Appends `{"step": ..., "time": <unix seconds>, <metric>: <value>, ...}` lines to `path`.

    The file is opened in append mode, so a resumed run continues the same file, and every line
    is flushed as it is written, so an interrupted run loses at most the line being written.
    Non-finite values are written as null.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one line for `step` and flush it to the OS."""
        for key in RESERVED_KEYS:
            if key in metrics:
                raise ValueError(f"metric name {key!r} is reserved in metrics.jsonl")
        record: dict[str, object] = {"step": int(step), "time": time.time()}
        record.update((name, _json_value(float(value))) for name, value in metrics.items())
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl, one per step in step order; nulls become NaN.

    A step logged twice (a run resumed from a checkpoint older than its last logged step) keeps
    its last record, which is the one the resumed run produced. A truncated last line (the
    process was killed mid-write) is skipped; a malformed line elsewhere is an error.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    by_step: dict[int, dict] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line") from None
        if "step" not in record:
            raise ValueError(f"{path}:{i + 1}: record has no 'step'")
        by_step[int(record["step"])] = {
            key: (math.nan if value is None else value) for key, value in record.items()
        }
    return [by_step[step] for step in sorted(by_step)]
