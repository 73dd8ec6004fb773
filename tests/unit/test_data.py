"""Prompt sources, procedural tasks, resumable batching and prompt rendering."""

from __future__ import annotations

import json
import logging
import random

import pytest

from slipstream.data.dataset import PromptDataset
from slipstream.data.formatting import render_prompt
from slipstream.data.sources import PromptRecord, load_prompts
from slipstream.data.tasks import get_task
from slipstream.rewards.registry import resolve_reward

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]

# verl-style rows: chat prompt, ground truth nested under reward_model.
VERL_ROWS = [
    {"data_source": "gsm8k", "prompt": CHAT, "reward_model": {"style": "rule", "ground_truth": "4"}},
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "3*3?"}],
     "reward_model": {"style": "rule", "ground_truth": "9"}},
]


def _write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")


# ---------------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------------


def test_jsonl_with_key_mapping(tmp_path):
    path = tmp_path / "data.jsonl"
    _write_jsonl(path, [{"question": "1+1?", "solution": 2, "id": 7}, "", {"question": "hi", "solution": None}])
    records = load_prompts(path, prompt_key="question", answer_key="solution")
    assert records == [
        PromptRecord(prompt="1+1?", answer="2", meta={"id": 7}),  # numeric answers become strings
        PromptRecord(prompt="hi", answer=None, meta={}),
    ]
    assert load_prompts(path, prompt_key="question", answer_key=None)[0].answer is None


def test_jsonl_nested_keys_and_chat_prompts(tmp_path):
    path = tmp_path / "verl.jsonl"
    _write_jsonl(path, VERL_ROWS)
    records = load_prompts(path, answer_key="reward_model.ground_truth")
    assert [r.answer for r in records] == ["4", "9"]
    assert records[0].prompt == CHAT
    # The parent of a nested answer key stays in meta (its "style" sibling may matter).
    assert records[0].meta == {"data_source": "gsm8k", "reward_model": {"style": "rule", "ground_truth": "4"}}


def test_malformed_rows_reported_with_line_and_skipped(tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    _write_jsonl(path, [
        {"prompt": "good one", "answer": "1"},          # line 1
        {"question": "where is the prompt", "answer": "2"},  # line 2: missing key
        "{not json",                                     # line 3
        {"prompt": 5, "answer": "3"},                    # line 4: wrong type
        "[1, 2]",                                        # line 5: not an object
        {"prompt": [{"role": "user"}], "answer": "4"},   # line 6: bad chat message
        {"prompt": "good two", "answer": "5"},           # line 7
    ])
    with caplog.at_level(logging.WARNING, logger="slipstream.data.sources"):
        records = load_prompts(path)
    assert [r.prompt for r in records] == ["good one", "good two"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "data.jsonl:2: missing key 'prompt' (keys: question, answer)" in text
    assert "data.jsonl:3: invalid JSON" in text
    assert "data.jsonl:4: 'prompt' must be a string or a non-empty list of chat messages, got int" in text
    assert "data.jsonl:5: row is a list" in text
    assert "data.jsonl:6: 'prompt' message 0" in text
    assert "skipped 5 malformed of 7 rows" in text

    with pytest.raises(ValueError, match=r"^data\.jsonl:2: missing key 'prompt' \(keys: question, answer\)$"):
        load_prompts(path, on_error="raise")
    with pytest.raises(ValueError, match=r"missing key 'reward_model.ground_truth' \(keys at 'reward_model': style\)"):
        _write_jsonl(path, [{"prompt": "p", "reward_model": {"style": "rule"}}])
        load_prompts(path, answer_key="reward_model.ground_truth", on_error="raise")


def test_non_utf8_row_is_a_malformed_row(tmp_path, caplog):
    # One stray byte (a latin-1 file, a truncated copy) must cost one row, not the run.
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "good one"}\n{"prompt": "caf\xe9 \xff"}\n{"prompt": "good two"}\n')
    with caplog.at_level(logging.WARNING, logger="slipstream.data.sources"):
        records = load_prompts(path, answer_key=None)
    assert [r.prompt for r in records] == ["good one", "good two"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "data.jsonl:2: not valid UTF-8" in text
    assert "skipped 1 malformed of 3 rows" in text
    with pytest.raises(ValueError, match=r"^data\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)$"):
        load_prompts(path, answer_key=None, on_error="raise")


def test_empty_result_and_bad_arguments(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_jsonl(path, [{"q": "x"}])
    with pytest.raises(ValueError, match="no usable prompts"):
        load_prompts(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_prompts(tmp_path / "data.csv")
    with pytest.raises(ValueError, match="on_error"):
        load_prompts(path, on_error="ignore")


def test_parquet(tmp_path, caplog):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = VERL_ROWS + [{"data_source": "x", "prompt": None, "reward_model": {"style": "rule", "ground_truth": "1"}}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with caplog.at_level(logging.WARNING, logger="slipstream.data.sources"):
        records = load_prompts(path, answer_key="reward_model.ground_truth")
    assert [r.answer for r in records] == ["4", "9"]
    assert records[0].prompt == CHAT and records[1].meta["data_source"] == "gsm8k"
    assert any("train.parquet:row 2: 'prompt' must be a string" in r.getMessage() for r in caplog.records)


def test_hf_load_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_list([{"problem": "1+2?", "sol": "3"}, {"problem": "2+2?", "sol": "4"}])
    test = datasets.Dataset.from_list([{"problem": "5+5?", "sol": "10"}])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    train.save_to_disk(str(tmp_path / "single"))

    records = load_prompts(tmp_path / "dd", prompt_key="problem", answer_key="sol")
    assert [(r.prompt, r.answer) for r in records] == [("1+2?", "3"), ("2+2?", "4")]
    records = load_prompts(tmp_path / "dd", prompt_key="problem", answer_key="sol", split="test")
    assert [(r.prompt, r.answer) for r in records] == [("5+5?", "10")]
    assert len(load_prompts(tmp_path / "single", prompt_key="problem", answer_key="sol")) == 2
    with pytest.raises(ValueError, match="no split 'validation' \\(splits: train, test\\)"):
        load_prompts(tmp_path / "dd", prompt_key="problem", answer_key="sol", split="validation")


# ---------------------------------------------------------------------------------------------
# tasks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,params", [
    ("arithmetic", {}),
    ("arithmetic", {"digits": 3, "ops": "+-*/"}),
    ("countdown", {}),
    ("countdown", {"num_numbers": 3, "max_number": 20, "max_target": 50}),
    ("sum-mod10", {}),
    ("sum-mod10", {"num_terms": 4}),
])
def test_tasks_deterministic_and_verified_by_their_reward(name, params):
    task = get_task(name, **params)
    a = [task.sample(random.Random(f"s{i}")) for i in range(40)]
    b = [task.sample(random.Random(f"s{i}")) for i in range(40)]
    assert a == b
    assert len({str(r.prompt) for r in a}) > 20  # not a constant
    reward = resolve_reward(task.reward)
    for record in a:
        if name == "arithmetic":
            correct = f"The result is \\boxed{{{eval(record.meta['expr'].replace('/', '//'))}}}"
        elif name == "countdown":
            correct = f"<answer>{record.meta['solution']}</answer>"
        else:
            correct = str(eval(record.prompt[:-1]) % 10)
        assert reward(correct, record.answer, record.prompt) == 1.0, (record, correct)
        wrong = "<answer>1 + 1</answer>" if name == "countdown" else "\\boxed{-123456789}"
        assert reward(wrong, record.answer, record.prompt) == 0.0


def test_sum_mod10_alphabet_and_task_errors():
    task = get_task("sum-mod10")
    rng = random.Random(0)
    for _ in range(50):
        r = task.sample(rng)
        assert set(r.prompt + r.answer) <= set(task.alphabet) and len(r.answer) == 1
        assert r.prompt.endswith("=") and r.prompt.count("+") == 1
    with pytest.raises(ValueError, match="did you mean 'countdown'"):
        get_task("countdwn")
    with pytest.raises(ValueError, match="no parameter"):
        get_task("arithmetic", digitz=3)
    with pytest.raises(ValueError, match="subset"):
        get_task("arithmetic", ops="+^")


# ---------------------------------------------------------------------------------------------
# dataset
# ---------------------------------------------------------------------------------------------


def _records(n):
    return [PromptRecord(prompt=f"p{i}", answer=str(i)) for i in range(n)]


def test_dataset_epochs_are_permutations_and_seeded():
    ds = PromptDataset(_records(10), seed=3)
    stream = [r.prompt for batch in ds.batches(batch_size=4, num_batches=5) for r in batch]  # 20 = 2 epochs
    assert sorted(stream[:10]) == sorted(stream[10:]) == sorted(f"p{i}" for i in range(10))
    assert stream[:10] != stream[10:]  # reshuffled per epoch
    assert ds.position == 20 and ds.epoch == 2
    other = PromptDataset(_records(10), seed=3)
    assert [r.prompt for b in other.batches(4, num_batches=5) for r in b] == stream
    different = PromptDataset(_records(10), seed=4)
    assert [r.prompt for b in different.batches(4, num_batches=5) for r in b] != stream
    ordered = PromptDataset(_records(10), shuffle=False)
    assert [r.prompt for r in next(ordered.batches(3))] == ["p0", "p1", "p2"]


@pytest.mark.parametrize("source", ["records", "task"])
def test_dataset_resume_gives_same_sequence(source):
    def make():
        return PromptDataset(_records(7)) if source == "records" else PromptDataset(get_task("sum-mod10"), epoch_size=7)

    full = make()
    reference = [[r.prompt for r in b] for b in full.batches(batch_size=3, seed=11, num_batches=8)]
    first = make()
    it = first.batches(batch_size=3, seed=11)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints go through a file
    resumed = make()
    resumed.load_state_dict(state)
    assert [[r.prompt for r in b] for b in resumed.batches(batch_size=3, num_batches=5)] == reference[3:]
    # start_index gives the same without a state dict (position 9 straddles an epoch of 7).
    again = make()
    assert [[r.prompt for r in b] for b in again.batches(3, seed=11, start_index=9, num_batches=5)] == reference[3:]


def test_dataset_rejects_mismatched_state_and_bad_input():
    ds = PromptDataset(_records(5))
    state = ds.state_dict()
    with pytest.raises(ValueError, match="records per epoch"):
        PromptDataset(_records(6)).load_state_dict(state)
    with pytest.raises(ValueError, match="at least one record"):
        PromptDataset([])
    with pytest.raises(ValueError, match="batch_size"):
        next(ds.batches(0))


# ---------------------------------------------------------------------------------------------
# formatting
# ---------------------------------------------------------------------------------------------


def test_render_prompt():
    text = PromptRecord(prompt="What is 2+2?", answer="4")
    assert render_prompt(text) == "What is 2+2?"
    template = "Q: {prompt}\nPut the answer in \\boxed{}.\nA:"
    assert render_prompt(text, template) == "Q: What is 2+2?\nPut the answer in \\boxed{}.\nA:"
    chat = PromptRecord(prompt=CHAT, answer="4")
    rendered = render_prompt(chat, template)
    assert rendered == CHAT and rendered is not CHAT
    with pytest.raises(ValueError, match="must contain"):
        render_prompt(text, "no placeholder")
