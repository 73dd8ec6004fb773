"""Reward functions, registry resolution and the sandboxed multi-process runner."""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import pytest

from slipstream.rewards.functions import (
    countdown_answer,
    countdown_reward,
    exact_reward,
    extract_boxed,
    format_reward,
    math_reward,
)
from slipstream.rewards.registry import CombinedReward, register_reward, resolve_reward, REWARDS
from slipstream.rewards.runner import RewardError, RewardRunner

FIXTURES = Path(__file__).with_name("rewards_fixtures.py")
MISBEHAVING = f"{FIXTURES}:misbehaving_reward"

# ---------------------------------------------------------------------------------------------
# math / exact / format / countdown
# ---------------------------------------------------------------------------------------------

MATH_CASES = [
    # (completion, ground truth, expected reward)
    ("So the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{41} hmm no, \\boxed{42}", "42", 1.0),  # last box wins
    ("\\boxed{42} and then 7 apples", "42", 1.0),  # a box beats a later plain number
    ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),  # nested braces
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fraction vs decimal, numerically
    ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),  # non-numeric: normalised string compare
    ("\\boxed{x^{2}+2}", "x^{2}+1", 0.0),
    ("\\boxed{\\text{B}}", "b", 1.0),
    ("First 3 then 12 so the total is 15", "15", 1.0),  # last number
    ("First 3 then 12 so the total is 15", "12", 0.0),
    ("It equals 3/4", "0.75", 1.0),
    ("It equals 3/4", "3/5", 0.0),
    ("The temperature is -7 degrees.", "-7", 1.0),
    ("The temperature is -7 degrees.", "7", 0.0),
    ("The temperature is \u22127", "-7", 1.0),  # unicode minus
    ("Total: $1,234,567.", "1234567", 1.0),  # $, thousands commas, trailing '.'
    ("\\boxed{\\$1,000}", "1000.00", 1.0),
    ("We get 2.50", "2.5", 1.0),
    ("We get .5", "1/2", 1.0),
    ("values 1,2,3", "3", 1.0),  # a list, not a thousands number
    ("no number here at all", "5", 0.0),
    ("", "0", 0.0),
    ("The answer is 18.", "Janet makes 9 * 2 = 18 dollars.\n#### 18", 1.0),  # GSM8K ground truth
    ("\\boxed{18", "18", 1.0),  # unclosed box: falls back to the last number
]


@pytest.mark.parametrize("completion,truth,expected", MATH_CASES)
def test_math_reward_cases(completion, truth, expected):
    assert math_reward(completion, truth, "") == expected


def test_math_reward_needs_answer_and_extract_boxed():
    with pytest.raises(ValueError, match="ground-truth"):
        math_reward("\\boxed{1}", None, "")
    assert extract_boxed("a \\boxed{b{c}{d{e}}} f") == "b{c}{d{e}}"
    assert extract_boxed("nothing") is None


def test_exact_reward():
    assert exact_reward("  Paris\n", "paris", "") == 1.0
    assert exact_reward("New   York", "new york", "") == 1.0
    assert exact_reward("New York City", "new york", "") == 0.0
    assert exact_reward("7", "7", "") == 1.0


def test_format_reward_default_and_custom_pattern():
    assert format_reward("think... <answer>4</answer>", None, "") == 1.0
    assert format_reward("<answer>\nmulti\nline\n</answer>", None, "") == 1.0
    assert format_reward("so \\boxed{4}", None, "") == 1.0
    assert format_reward("the answer is 4", None, "") == 0.0
    assert format_reward("<answer>4", None, "") == 0.0
    think = functools.partial(format_reward, pattern=r"^<think>.*</think>")
    assert think("<think>hm</think> 4", None, "") == 1.0
    assert think("4 <think>hm</think>", None, "") == 0.0


def test_countdown_reward():
    truth = countdown_answer([3, 5, 7, 2], 31)
    assert countdown_reward("<answer>7 * 3 + 5 * 2</answer>", truth, "") == 1.0
    assert countdown_reward("reasoning\n<answer>7*3 + 5*2 = 31</answer>", truth, "") == 1.0  # "= target"
    assert countdown_reward("so \\boxed{(7 * 3) + (5 * 2)}", truth, "") == 1.0
    assert countdown_reward("7 \u00d7 3 + 5 \u00d7 2", truth, "") == 1.0  # last line, unicode times
    assert countdown_reward("<answer>5 * (3 + 2) + 7</answer>", truth, "") == 0.0  # = 32
    assert countdown_reward("<answer>7 * 3 + 5 * 2 + 0</answer>", truth, "") == 0.0  # 0 not given
    assert countdown_reward("<answer>7 * 3 + 5 + 5</answer>", truth, "") == 0.0  # 5 twice, 2 unused
    assert countdown_reward("<answer>7 * 3 + 10</answer>", truth, "") == 0.0  # numbers not used
    assert countdown_reward("<answer>7 * 3 + 5 * 2 / 0</answer>", truth, "") == 0.0
    assert countdown_reward("<answer>__import__('os')</answer>", truth, "") == 0.0  # never evaluated
    assert countdown_reward("<answer>7 ** 3</answer>", truth, "") == 0.0
    assert countdown_reward("", truth, "") == 0.0
    # Exact rational arithmetic: 7 / 2 * 2 is exactly 7 (no float rounding), so this is 17.
    truth = countdown_answer([7, 2, 2, 5], 17)
    assert countdown_reward("<answer>7 / 2 * 2 + 5 * 2</answer>", truth, "") == 0.0  # 2 three times
    assert countdown_reward("<answer>7 / 2 * 2 + 5 * 2</answer>", countdown_answer([7, 2, 2, 5, 2], 17), "") == 1.0


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


def test_resolve_builtin_and_unknown_name():
    assert resolve_reward("math") is math_reward
    with pytest.raises(ValueError, match="did you mean 'math'"):
        resolve_reward("maths")
    with pytest.raises(ValueError, match="did you mean 'format'"):
        resolve_reward("fromat")


def test_resolve_module_and_file_specs(tmp_path, monkeypatch):
    assert resolve_reward("slipstream.rewards.functions:exact_reward") is exact_reward
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "scoring.py").write_text(
        "def shout(completion, answer, prompt):\n    return float(completion.isupper())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    shout = resolve_reward("my_rewards_pkg.scoring:shout")
    assert shout("HI", None, "") == 1.0 and shout("hi", None, "") == 0.0

    fn = resolve_reward(f"{FIXTURES}:length_reward")
    assert fn("abcd", None, "") == 4.0
    assert resolve_reward(f"{FIXTURES}:length_reward") is fn  # the file is imported once
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        resolve_reward(f"{FIXTURES}:nope")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_reward(f"{tmp_path}/missing.py:fn")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward("no_such_module_xyz:fn")


def test_register_and_combined_reward():
    register_reward("test_length", resolve_reward(f"{FIXTURES}:length_reward"))
    try:
        combo = CombinedReward([("math", 2.0), ("format", 0.5), ("test_length", 0.1)])
        total, info = combo.score("so \\boxed{7}", "7", "")
        # exact arithmetic: measured 0
        assert total == pytest.approx(2.0 * 1 + 0.5 * 1 + 0.1 * len("so \\boxed{7}"))
        assert info == {"math": 1.0, "format": 1.0, "test_length": float(len("so \\boxed{7}"))}
        total, _ = combo.score("it is 8", "7", "")
        # exact arithmetic: measured 0
        assert total == pytest.approx(0.1 * 7)
        with pytest.raises(ValueError, match="must not contain ':'"):
            register_reward("a:b", math_reward)
        with pytest.raises(ValueError, match="finite number"):
            CombinedReward([("math", float("nan"))])
    finally:
        REWARDS.pop("test_length")


# ---------------------------------------------------------------------------------------------
# runner
# ---------------------------------------------------------------------------------------------

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def misbehaving_runner():
    with RewardRunner([(MISBEHAVING, 1.0)], num_workers=2, timeout_s=TIMEOUT_S, error_score=-1.0) as runner:
        yield runner


def test_runner_matches_inline_and_uses_worker_processes():
    specs = [("math", 1.0), ("format", 0.5), (f"{FIXTURES}:pid_reward", 0.0)]
    items = [(f"step {i} \\boxed{{{i % 3}}}" if i % 2 else f"it is {i}", "1", "q") for i in range(12)]
    with RewardRunner(specs, num_workers=2, timeout_s=10.0) as runner:
        parallel = runner.score(items)
        again = runner.score(items[:3])  # workers are reused across calls
    inline = RewardRunner(specs, num_workers=0).score(items)
    for (p_score, p_info), (i_score, i_info) in zip(parallel, inline):
        assert p_score == i_score
        assert p_info["math"] == i_info["math"] and p_info["format"] == i_info["format"]
    # Odd items are boxed (format 0.5) and correct when i % 3 == 1; even items end in i != 1.
    expected = [(1.0 if i % 3 == 1 else 0.0) + 0.5 if i % 2 else 0.0 for i in range(12)]
    assert [s for s, _ in parallel] == expected
    pids = {info["pid_reward/pid"] for _, info in parallel + again}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_runner_raising_reward_is_scored_and_logged(misbehaving_runner, caplog):
    items = [("abc", None, ""), ("raise", None, ""), ("hello", None, ""), ("nan", None, "")]
    with caplog.at_level(logging.WARNING, logger="slipstream.rewards.runner"):
        results = misbehaving_runner.score(items)
    assert [s for s, _ in results] == [3.0, -1.0, 5.0, -1.0]
    assert "ZeroDivisionError" in results[1][1]["error"]
    assert "non-finite" in results[3][1]["error"]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1  # one line for the batch, with the first failure
    assert "ZeroDivisionError: deliberate failure" in messages[0] and "'raise'" in messages[0]
    assert "misbehaving_reward raised on 2/4" in messages[0]


def test_runner_hanging_reward_times_out_and_pool_recovers(misbehaving_runner):
    misbehaving_runner.score([("warm", None, ""), ("up", None, "")])  # make sure both workers are up
    items = [("ab", None, ""), ("abcd", None, ""), ("x", None, ""), ("hang", None, ""), ("hang", None, "")]
    t0 = time.monotonic()
    results = misbehaving_runner.score(items)
    elapsed = time.monotonic() - t0
    # The hung worker is killed at the deadline; the second "hang" is a call of the function that just
    # timed out, so it is not run in this batch (or is stopped, when the other worker had started it).
    assert [s for s, _ in results] == [2.0, 4.0, 1.0, -1.0, -1.0]
    failures = {"misbehaving_reward": "timeout"}
    assert results[3][1] == {"error": f"misbehaving_reward: timeout after {TIMEOUT_S:g}s", "failures": failures}
    second = results[4][1]["error"]  # not run, or (under load the other worker started it) timed out too
    assert results[4][1]["failures"] == failures and ("earlier in this batch" in second or "timeout after" in second)
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.5, elapsed
    assert [s for s, _ in misbehaving_runner.score([("abc", None, ""), ("z", None, "")])] == [3.0, 1.0]


def test_runner_every_worker_hanging(misbehaving_runner):
    items = [("hang", None, ""), ("ab", None, ""), ("hang", None, ""), ("x", None, "")]
    t0 = time.monotonic()
    results = misbehaving_runner.score(items)
    # Both workers hang at once and time out together; the calls behind them are not run.
    assert [s for s, _ in results] == [-1.0, -1.0, -1.0, -1.0]
    assert time.monotonic() - t0 < TIMEOUT_S + 1.5
    assert [s for s, _ in misbehaving_runner.score([("abc", None, "")] * 5)] == [3.0] * 5


def test_runner_worker_crash_is_scored(misbehaving_runner):
    results = misbehaving_runner.score([("exit", None, ""), ("four", None, "")])
    assert results[0][0] == -1.0 and "died" in results[0][1]["error"]
    assert results[1] == (4.0, {"misbehaving_reward": 4.0})
    assert misbehaving_runner.score([("ok", None, "")])[0][0] == 2.0


def test_runner_sends_runtime_registered_and_file_loaded_callables():
    register_reward("test_file_length", resolve_reward(f"{FIXTURES}:length_reward"))
    try:
        pid_fn = resolve_reward(f"{FIXTURES}:pid_reward")  # a callable from a file, not importable by name
        with RewardRunner([("test_file_length", 1.0), (pid_fn, 2.0)], num_workers=1, timeout_s=10.0) as runner:
            (score, info), = runner.score([("abcde", None, "")])
    finally:
        REWARDS.pop("test_file_length")
    assert score == 5.0 + 2.0 and info["test_file_length"] == 5.0 and info["pid_reward/pid"] != os.getpid()


def test_runner_on_error_raise():
    with RewardRunner([(MISBEHAVING, 1.0)], num_workers=1, timeout_s=TIMEOUT_S, on_error="raise") as runner:
        with pytest.raises(RewardError, match="ZeroDivisionError"):
            runner.score([("a", None, ""), ("raise", None, ""), ("bc", None, "")])
        assert runner.score([("abc", None, "")]) == [(3.0, {"misbehaving_reward": 3.0})]  # still usable
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        RewardRunner([(MISBEHAVING, 1.0)], on_error="raise").score([("raise", None, "")])


def test_runner_inline_errors_and_bad_arguments(caplog):
    runner = RewardRunner([("math", 1.0)], num_workers=0, error_score=-0.5)
    with caplog.at_level(logging.WARNING, logger="slipstream.rewards.runner"):
        results = runner.score([("\\boxed{3}", "3", ""), ("\\boxed{3}", None, "")])  # math needs an answer
    assert results[0] == (1.0, {"math": 1.0})
    assert results[1][0] == -0.5 and "ground-truth" in results[1][1]["error"]
    assert any("ground-truth" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="on_error"):
        RewardRunner([("math", 1.0)], on_error="ignore")
    with pytest.raises(ValueError, match="did you mean"):
        RewardRunner([("mathh", 1.0)], num_workers=2)
    with pytest.raises(ValueError, match="cannot be sent to worker"):
        RewardRunner([(lambda c, a, p: 0.0, 1.0)], num_workers=1)


def test_runner_counts_errors_per_function_and_logs_once(caplog):
    specs = [(f"{FIXTURES}:length_reward", 1.0), (f"{FIXTURES}:always_raising_reward", 1.0)]
    runner = RewardRunner(specs, num_workers=0, error_score=-1.0)
    with caplog.at_level(logging.WARNING, logger="slipstream.rewards.runner"):
        results = runner.score([("ab", None, ""), ("abc", None, ""), ("", None, "")])
    assert [r for r, _ in results] == [-1.0] * 3
    assert results[1][1] == {"length_reward": 3.0, "failures": {"always_raising_reward": "error"},
                             "error": "always_raising_reward: RuntimeError: this reward always fails"}  # fmt: skip
    (record,) = caplog.records  # one line for the batch, not one per completion
    assert "always_raising_reward raised on 3/3" in record.getMessage() and "always fails" in record.getMessage()


def test_hanging_function_costs_one_timeout_per_batch_then_is_disabled(caplog):
    """Every call of always_hanging_reward hangs: each batch pays one timeout (not one per completion),
    and after `disable_after` such batches the function is dropped from the sum."""
    timeout, n = 1.0, 8
    specs = [(f"{FIXTURES}:length_reward", 1.0), (f"{FIXTURES}:always_hanging_reward", 1.0)]
    items = [("x" * k, None, "") for k in range(n)]
    with RewardRunner(specs, num_workers=1, timeout_s=timeout, disable_after=2) as runner:
        for _ in range(2):
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="slipstream.rewards.runner"):
                results = runner.score(items)
            assert time.monotonic() - t0 < n * timeout  # serial timeouts would take n * timeout and more
            assert all(r == 0.0 and info["failures"] == {"always_hanging_reward": "timeout"} for r, info in results)
            assert [info["length_reward"] for _, info in results] == list(range(n))  # the other function ran
        assert runner.disabled == {"always_hanging_reward"}
        assert any("always_hanging_reward timed out on every call for 2 batches (steps)" in r.getMessage() and
                   "scored by length_reward" in r.getMessage() for r in caplog.records)  # fmt: skip
        assert runner.score(items) == [(float(k), {"length_reward": float(k)}) for k in range(n)]
    only_hanging = [(f"{FIXTURES}:always_hanging_reward", 1.0)]
    with RewardRunner(only_hanging, num_workers=1, timeout_s=0.3, disable_after=1) as runner:
        with pytest.raises(RewardError, match="every reward function is disabled"):
            runner.score(items[:2])


def test_answer_extraction_modes():
    from slipstream.rewards.extract import extract_answer

    text = "I think <answer>41</answer>\nso \\boxed{42}\nThe answer is 43."
    assert [extract_answer(text, how) for how in ("tag", "boxed", "last_line", "last_number", "auto")] == [
        "41", "42", "The answer is 43.", "43", "41",
    ]  # fmt: skip
    assert extract_answer("no tags\n\n  final  \n") == "final"
    assert extract_answer("   ") is None and extract_answer("x", "tag") is None
    assert math_reward("The answer is 43.", "43", "", "last_line") == 1.0  # the last number of the last line
    assert math_reward("<answer>41</answer> and 43", "41", "") == 1.0  # auto: the tag first
    with pytest.raises(ValueError, match="answer extraction"):
        extract_answer("x", "first_line")


def test_reward_workers_are_created_with_sigint_blocked(monkeypatch):
    """A Ctrl-C sent to the process group while a worker's interpreter starts must not reach it. The
    worker is exec'd with SIGINT blocked, including the first one, whose spawn also starts
    multiprocessing's resource tracker (whose start unblocks SIGINT in the calling thread)."""
    import signal
    from multiprocessing import resource_tracker, util

    fresh = resource_tracker.ResourceTracker()  # not yet running, as in a new `slipstream train`
    monkeypatch.setattr(resource_tracker, "ensure_running", fresh.ensure_running)
    monkeypatch.setattr(resource_tracker, "getfd", fresh.getfd)
    masks = []
    spawn = util.spawnv_passfds

    def recording(path, args, passfds):
        if any("spawn_main" in os.fsdecode(a) for a in args):  # a worker, not the tracker
            masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return spawn(path, args, passfds)

    monkeypatch.setattr(util, "spawnv_passfds", recording)
    try:
        with RewardRunner([("exact", 1.0)], num_workers=2, timeout_s=10.0) as runner:
            assert runner.score([("7", "7", "")])[0][0] == 1.0
    finally:
        fresh._stop()
    assert len(masks) == 2 and all(signal.SIGINT in m for m in masks), masks
