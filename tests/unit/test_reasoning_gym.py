"""reasoning-gym: the rg source is seeded and resumable, the rg reward agrees with score_answer, a
missing package is one clear line. Tests that need the package skip without it."""

import json
import random
import sys

import pytest

from slipstream.cli import main
from slipstream.data import PromptDataset, make_task
from slipstream.rewards import reasoning_gym as rg_datasets
from slipstream.data.reasoning_gym import parse_rg_source
from slipstream.rewards.reasoning_gym import rg_reward
from slipstream.rewards.runner import RewardRunner

# tasks with numeric, word and expression answers
DATASETS = {
    "chain_sum": {"min_terms": 2, "max_terms": 3},
    "leg_counting": {"min_animals": 1, "max_animals": 3},
    "basic_arithmetic": {},
    "countdown": {},
    "letter_counting": {},
    "prime_factorization": {},
}


def test_parse_rg_source_needs_no_package():
    assert parse_rg_source("rg:chain_sum", {"min_terms": 2}) == [("chain_sum", 1.0, {"min_terms": 2})]
    mix = parse_rg_source("rg:mix:chain_sum=3,leg_counting", {"leg_counting": {"max_animals": 2}})
    assert mix == [("chain_sum", 3.0, {}), ("leg_counting", 1.0, {"max_animals": 2})]
    for bad in ("rg:", "rg:a,b", "rg:mix:a=x", "rg:mix:a=0", "rg:mix:a,a"):
        with pytest.raises(ValueError):
            parse_rg_source(bad, {})
    with pytest.raises(ValueError, match="keyed by dataset name"):
        parse_rg_source("rg:mix:a,b", {"min_terms": 2})


def test_missing_reasoning_gym_is_one_clear_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    rg_datasets._create.cache_clear()
    with pytest.raises(ValueError) as err:
        make_task("rg:chain_sum", {})
    assert 'pip install -e ".[tasks]"' in str(err.value) and "\n" not in str(err.value)
    assert main(["train", "recipes/demo.yaml", "data.source=rg:chain_sum", f"trainer.run_dir={tmp_path}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and 'pip install -e ".[tasks]"' in lines[0], lines
    rg_datasets._create.cache_clear()


def _fake_answer(name, entry):
    return "wrong" if name == "letter_counting" else "0 + 0 = 12345"


def test_rg_reward_agrees_with_score_answer():
    rg = pytest.importorskip("reasoning_gym")
    for name, params in DATASETS.items():
        task = make_task(f"rg:{name}", params)
        scorer = rg.create_dataset(name, **params)
        for seed in range(5):
            record = task.sample(random.Random(seed))
            spec = json.loads(record.answer)  # the entry travels as JSON, as it does to reward workers
            entry = spec["entry"]
            assert record.prompt == entry["question"] and spec["dataset"] == name
            right = scorer.score_answer(entry["answer"], entry)
            assert right == 1.0, (name, entry)
            assert rg_reward(f"Let me think.\n{entry['answer']}", record.answer, "", "last_line") == right
            assert rg_reward(f"<answer>{entry['answer']}</answer>", record.answer, "", "tag") == right
            wrong = _fake_answer(name, entry)
            assert rg_reward(wrong, record.answer, "", "last_line") < 1.0
            assert rg_reward("", record.answer, "") < 1.0


def test_rg_entries_reach_reward_workers():
    pytest.importorskip("reasoning_gym")
    task = make_task("rg:chain_sum", {})
    records = [task.sample(random.Random(i)) for i in range(4)]
    items = [(json.loads(r.answer)["entry"]["answer"], r.answer, r.prompt) for r in records]
    items += [("-1", r.answer, r.prompt) for r in records]
    with RewardRunner("rg", num_workers=1) as runner:
        scores = [s for s, _ in runner.score(items)]
    assert scores == [1.0] * 4 + [0.0] * 4


def test_rg_stream_is_seeded_and_resumable():
    pytest.importorskip("reasoning_gym")
    task = make_task("rg:mix:chain_sum=3,leg_counting", {"leg_counting": {"max_animals": 3}})
    a = PromptDataset(task, seed=5)
    first = [r.prompt for batch in a.batches(8, num_batches=3) for r in batch]
    b = PromptDataset(task, seed=5)
    b.load_state_dict({**a.state_dict(), "position": 8})
    assert [r.prompt for r in next(b.batches(16))] == first[8:]
    names = [json.loads(task.sample(random.Random(i)).answer)["dataset"] for i in range(400)]
    assert 0.65 < names.count("chain_sum") / len(names) < 0.85  # weights 3 : 1
    with pytest.raises(ValueError, match="did you mean 'chain_sum'"):
        make_task("rg:chain_sums", {})
    with pytest.raises(ValueError, match="has no parameter"):
        make_task("rg:chain_sum", {"min_term": 2})
