"""Prompt sources: JSONL, parquet and HF `datasets` directories, mapped onto `PromptRecord`s."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class PromptRecord:
    """One prompt: raw text or chat messages, its ground-truth answer, and the row's other fields."""

    prompt: str | list[dict]
    """Raw text, or chat messages [{"role": ..., "content": ...}, ...] for the tokenizer's template."""
    answer: str | None = None
    """Ground truth passed to the reward function (None when the rewards do not need one)."""
    meta: dict = field(default_factory=dict)
    """Every other top-level field of the source row (ids, data source, difficulty, ...)."""
    where: str = field(default="", compare=False)
    """The row's place in its file ("data.jsonl:12"), for messages; empty for procedural prompts."""


def _lookup(row: dict, dotted: str) -> Any:
    """row["a"]["b"] for "a.b"; raises KeyError(message) naming the keys that do exist."""
    node: Any = row
    walked: list[str] = []
    for part in dotted.split("."):
        if not isinstance(node, dict):
            where = ".".join(walked)
            raise KeyError(f"missing key {dotted!r} ({where!r} is a {type(node).__name__}, not an object)")
        if part not in node:
            where = f" at {'.'.join(walked)!r}" if walked else ""
            raise KeyError(f"missing key {dotted!r} (keys{where}: {', '.join(map(str, node)) or 'none'})")
        node = node[part]
        walked.append(part)
    return node


def _check_prompt(value: Any, key: str) -> str | list[dict]:
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{key!r} is an empty string")
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"{key!r} message {i} must be an object with string 'role' and 'content', got {m!r:.80}")
            messages.append(dict(m))
        return messages
    raise ValueError(f"{key!r} must be a string or a non-empty list of chat messages, got {type(value).__name__}")


def _check_answer(value: Any, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    # Numeric ground truths (GSM8K-style ints) become strings; rewards compare text or numbers.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{key!r} must be a string, a number or null, got {type(value).__name__}")


def row_to_record(row: Any, prompt_key: str, answer_key: str | None, where: str = "") -> PromptRecord:
    """Map one source row onto a PromptRecord; ValueError with a readable reason if malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, expected an object")
    try:
        prompt = _check_prompt(_lookup(row, prompt_key), prompt_key)
        answer = _check_answer(_lookup(row, answer_key), answer_key) if answer_key is not None else None
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    # A nested key ("reward_model.ground_truth") keeps its parent in meta: siblings like
    # "reward_model.style" may still matter to a reward.
    meta = {k: v for k, v in row.items() if k != prompt_key and k != answer_key}
    return PromptRecord(prompt=prompt, answer=answer, meta=meta, where=where)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    # Bytes in, decoded per line: one non-UTF-8 byte is then one malformed row with its line
    # number, where a text-mode file would abort the whole read naming neither.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path.name}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, ValueError(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, ValueError(f"invalid JSON ({e})")


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError("reading parquet needs pyarrow: pip install 'slipstream[data]'") from e
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield f"{path.name}:row {index}", row
            index += 1


def _hf_rows(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as e:
        raise ValueError("reading a saved HF dataset needs `datasets`: pip install 'slipstream[data]'") from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    for index, row in enumerate(ds):
        yield f"{path.name}[{split}]:row {index}", row


def _infer_format(path: Path) -> str:
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"cannot tell the format of {str(path)!r}; pass fmt='jsonl', 'parquet' or 'hf'")


def load_prompts(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    on_error: str = "skip",
    fmt: str | None = None,
    split: str = "train",
) -> list[PromptRecord]:
    """Read prompts from a .jsonl file, a .parquet file or a `save_to_disk` dataset directory.

    Keys may be dotted paths into nested objects ("reward_model.ground_truth"). answer_key=None
    reads no answers. Malformed rows are reported as "file:line: reason" and skipped with a
    warning (on_error="skip") or raised as ValueError (on_error="raise").
    """
    path = Path(path)
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if not path.exists():
        raise ValueError(f"prompt source {str(path)!r} does not exist")
    fmt = fmt or _infer_format(path)
    if fmt == "jsonl":
        rows = _jsonl_rows(path)
    elif fmt == "parquet":
        rows = _parquet_rows(path)
    elif fmt == "hf":
        rows = _hf_rows(path, split)
    else:
        raise ValueError(f"unknown fmt {fmt!r}; expected 'jsonl', 'parquet' or 'hf'")

    records: list[PromptRecord] = []
    num_skipped = 0
    for where, row in rows:
        try:
            if isinstance(row, ValueError):
                raise row
            records.append(row_to_record(row, prompt_key, answer_key, where))
        except ValueError as e:
            message = f"{where}: {e}"
            if on_error == "raise":
                raise ValueError(message) from None
            logger.warning("skipping malformed row %s", message)
            num_skipped += 1
    if not records:
        raise ValueError(f"{path}: no usable prompts ({num_skipped} malformed rows skipped)")
    if num_skipped:
        logger.warning("%s: skipped %d malformed of %d rows", path.name, num_skipped, num_skipped + len(records))
    return records
