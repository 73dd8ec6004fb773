"""Eval: pass@k against the estimator, mean@n / maj@n, the schedule, held-out prompts, prompt-length filter."""

import math

import pytest

from slipstream.config import load_config
from slipstream.controller.prompts import PromptSource
from slipstream.data.heldout import prompt_hash
from slipstream.eval import EvalSchedule, build_eval_sets, excluded_hashes, generate_keyed, pass_at_k, set_metrics
from slipstream.eval.metrics import Completion, ProblemResult, majority_correct
from slipstream.models.presets import get_preset
from slipstream.models.tokenizer import build_char_tokenizer
from slipstream.rollout.base import SamplingParams
from slipstream.rollout.builtin import BuiltinRollout


def _binomial_pass_at_k(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n", [1, 4, 8, 16])
def test_pass_at_k_matches_the_binomial_estimator(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            # both in float64: measured error at most 1.1e-16
            assert pass_at_k(n, c, k) == pytest.approx(_binomial_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(n, 0, n + 1)


def test_pass_at_k_hand_made():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # one of four
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # C(6,4)=15, C(8,4)=70
    assert pass_at_k(8, 5, 4) == 1.0  # n - c < k


def _c(correct, answer, length=3, truncated=False):
    return Completion(score=float(correct), correct=correct, answer=answer, response_len=length, truncated=truncated)


def test_set_metrics_mean_pass_maj_and_lengths():
    results = [
        # greedy right; samples 1 of 4 right, the majority ("5") wrong
        ProblemResult(0, _c(True, "7"), (_c(True, "7"), _c(False, "5"), _c(False, "5"), _c(False, None))),
        # greedy wrong (and truncated); samples 3 of 4 right
        ProblemResult(1, _c(False, "1", 8, True), (_c(True, "2"), _c(True, "2"), _c(False, "3"), _c(True, "2"))),
    ]
    m = set_metrics("s", results, [1, 4])
    assert m["eval/s/accuracy"] == 0.5
    # means of quarters: exact in float64 (approx's default rel=1e-6 only guards the summation order)
    assert m["eval/s/mean@4"] == pytest.approx(4 / 8)
    assert m["eval/s/pass@1"] == pytest.approx((0.25 + 0.75) / 2)
    assert m["eval/s/pass@4"] == 1.0
    assert m["eval/s/maj@4"] == 0.5
    assert m["eval/s/resp_len"] == 5.5 and m["eval/s/truncated_frac"] == 0.5
    # default pass_k: 1 and n; no greedy completions: lengths of the samples
    m = set_metrics("s", [ProblemResult(0, None, (_c(True, "1"), _c(False, "2")))], [])
    assert set(m) >= {"eval/s/pass@1", "eval/s/pass@2", "eval/s/mean@2", "eval/s/maj@2"} and "eval/s/accuracy" not in m


def test_majority_ties_go_to_the_first_answer_seen():
    assert majority_correct((_c(False, "a"), _c(True, "b"), _c(True, "b"), _c(False, "a")))is False
    assert majority_correct((_c(False, None), _c(False, None))) is False


def test_schedule_and_its_state():
    sched = EvalSchedule(every=3, before_training=True, total_steps=7)
    assert [s for s in range(8) if sched.due(s)] == [0, 3, 6, 7]
    sched.last_step = 3  # what a checkpoint taken after the step-3 eval restores
    restored = EvalSchedule(every=3, before_training=True, total_steps=7)
    restored.load_state_dict(sched.state_dict())
    assert [s for s in range(8) if restored.due(s)] == [6, 7]
    assert [s for s in range(8) if EvalSchedule(0, False, 7).due(s)] == [7]


def _cfg(*overrides):
    return load_config(None, ["model.use_chat_template=false", "rollout.prompts_per_step=16", *overrides])


def test_held_out_prompts_never_reach_training():
    # two-term sum-mod10 has 100 problems; 30 are held out, the training stream must never show them
    cfg = _cfg("data.task_params={num_terms: 2}", "eval.sets={held: {size: 30}}")
    tok = build_char_tokenizer()
    (held,) = build_eval_sets(cfg, tok)
    assert held.held_out and len(held.problems) == 30 and len(held.hashes) == 30
    source = PromptSource(cfg, tok, exclude=excluded_hashes([held]))
    seen = [p.prompt_text for _ in range(200) for p in source.next_batch()]  # 3200 training prompts
    assert len(seen) == 3200
    assert not {prompt_hash(t) for t in seen} & held.hashes
    assert len(set(seen)) == 70  # every other problem still shows up
    assert source.metrics()["data/eval_prompts_skipped"] > 0
    # the skipped prompts are part of the stream position: a resumed stream continues identically
    state = source.state_dict()
    resumed = PromptSource(cfg, tok, exclude=excluded_hashes([held]))
    resumed.load_state_dict(state)
    assert [p.prompt_text for p in resumed.next_batch()] == [p.prompt_text for p in source.next_batch()]


def test_eval_set_covering_the_whole_space_is_not_held_out():
    cfg = _cfg("data.task_params={num_terms: 1}", "eval.sets={all: {size: 50}}")
    (whole,) = build_eval_sets(cfg, build_char_tokenizer())
    assert len(whole.problems) == 10 and whole.covers_space and not whole.held_out
    assert excluded_hashes([whole]) == frozenset()
    # the same space as a separate source (another task's params) is still excluded from training
    cfg = _cfg("data.task_params={num_terms: 2}", "eval.sets={other: {task_params: {num_terms: 1}, size: 50}}")
    (other,) = build_eval_sets(cfg, build_char_tokenizer())
    assert other.covers_space and other.held_out


def test_max_prompt_length_drops_and_counts(tmp_path):
    rows = ["1+1=", "1+1+1+1+1+1=", "2+2=", "3+3+3+3+3+3+3="]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "{r}", "answer": "0"}}\n' for r in rows))
    cfg = _cfg(f"data.source={path}", "rollout.prompts_per_step=4", "data.max_prompt_length=6", "data.shuffle_seed=3")
    source = PromptSource(cfg, build_char_tokenizer())
    batch = source.next_batch()
    assert all(len(p.prompt_ids) <= 6 for p in batch) and {p.prompt_text for p in batch} == {"1+1=", "2+2="}
    # every prompt the stream passed over and did not hand out was counted
    assert source.metrics()["data/filtered_prompts"] == source.dataset.position - 4 >= 2
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        PromptSource(_cfg(f"data.source={path}", "data.max_prompt_length=1"), build_char_tokenizer()).next_batch()


def test_generate_keyed_passes_keys_and_leaves_the_training_stream_as_it_was():
    class Keyed:
        def generate(self, prompts, sampling, keys=None):
            self.keys = keys
            return [[] for _ in prompts]

    engine = Keyed()
    generate_keyed(engine, [[1], [2]], SamplingParams(), [7, 8])
    assert engine.keys == [7, 8]

    rollout = BuiltinRollout(get_preset("tiny"), max_batch_size=4, seed=3)
    before = rollout.state_dict()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3, n=2)
    first = generate_keyed(rollout, [[1, 5], [1, 6]], sampling, [11, 12])
    assert rollout.state_dict() == before  # the key counter of training calls did not move
    again = generate_keyed(rollout, [[1, 5], [1, 6]], sampling, [11, 12])
    assert [[s.response_ids for s in g] for g in first] == [[s.response_ids for s in g] for g in again]


def test_sets_sharing_problems_share_their_completions():
    from slipstream.eval import Evaluator

    cfg = _cfg("data.task_params={num_terms: 2}", "reward.num_workers=0", "rollout.max_new_tokens=2", "eval.n=2",
               "eval.sets={a: {size: 8}, b: {size: 8, reward: [math]}, c: {size: 8, seed: 2}}")  # fmt: skip
    tok = build_char_tokenizer()
    sets = build_eval_sets(cfg, tok)
    rollout = BuiltinRollout(get_preset("tiny"), max_batch_size=64, seed=0)
    calls = []
    generate = rollout.generate
    rollout.generate = lambda prompts, sampling, keys: calls.append(sampling.n) or generate(prompts, sampling, keys=keys)
    evaluator = Evaluator.build(cfg, tok, rollout, sets, [tok.eos_token_id])
    metrics = evaluator.run()
    evaluator.close()
    assert calls == [2, 1, 2, 1]  # sets a and b (the same problems): once; set c: its own problems
    assert {"eval/a/accuracy", "eval/b/pass@2", "eval/c/maj@2", "perf/eval_time"} <= set(metrics)


def _long_prompt_rows(tmp_path):
    # line 2 is longer than the tiny model's whole context (2048): it cannot be generated from
    path = tmp_path / "long.jsonl"
    rows = ["1+1=", "1+" * 1100 + "1=", "2+2=", "3+3="]
    path.write_text("".join(f'{{"prompt": "{r}", "answer": "0"}}\n' for r in rows))
    return path


def test_eval_sets_drop_prompts_longer_than_the_context_and_count_them(tmp_path, caplog):
    from slipstream.eval import Evaluator

    path = _long_prompt_rows(tmp_path)
    # the default eval set is the training source; data.max_prompt_length is unset
    cfg = _cfg(f"data.source={path}", "eval.sets={t: {size: 4}}", "reward.num_workers=0", "rollout.max_new_tokens=2")
    tok = build_char_tokenizer()
    context = get_preset("tiny").max_position_embeddings
    with caplog.at_level("WARNING", logger="slipstream.eval.sets"):
        (t,) = build_eval_sets(cfg, tok, max_context=context)
    assert "eval set 't': skipping prompt long.jsonl:2: 2203 tokens, longer than 2046" in caplog.text
    assert len(t.problems) == 3 and t.num_filtered == 1
    assert sorted(p.index for p in t.problems) == [0, 1, 2]
    rollout = BuiltinRollout(get_preset("tiny"), max_batch_size=8, seed=0)
    evaluator = Evaluator.build(cfg, tok, rollout, [t], [tok.eos_token_id])
    metrics = evaluator.run()  # the long prompt would fail generate: prompt + max_new_tokens > context
    evaluator.close()
    assert metrics["eval/t/filtered_prompts"] == 1.0 and metrics["eval/t/num_problems"] == 3


def test_max_prompt_length_applies_to_eval_sets(tmp_path):
    cfg = _cfg(f"data.source={_long_prompt_rows(tmp_path)}", "eval.sets={t: {size: 4}}", "data.max_prompt_length=6")
    (t,) = build_eval_sets(cfg, build_char_tokenizer())
    assert t.num_filtered == 1 and all(len(p.prompt_ids) <= 6 for p in t.problems)
    with pytest.raises(ValueError, match=r"eval set 't': all 4 prompts are longer than 1 tokens \(data.max_prompt_length=1\)"):
        build_eval_sets(_cfg(f"data.source={_long_prompt_rows(tmp_path)}", "eval.sets={t: {size: 4}}",
                             "data.max_prompt_length=1"), build_char_tokenizer())  # fmt: skip


def test_training_stream_drops_prompts_longer_than_the_context(tmp_path, caplog):
    cfg = _cfg(f"data.source={_long_prompt_rows(tmp_path)}", "rollout.prompts_per_step=6", "rollout.max_new_tokens=2")
    with caplog.at_level("WARNING", logger="slipstream.controller.prompts"):
        source = PromptSource(cfg, build_char_tokenizer(), max_context=get_preset("tiny").max_position_embeddings)
        batch = source.next_batch()
    assert all(len(p.prompt_ids) <= 2046 for p in batch)
    assert source.metrics()["data/filtered_prompts"] == source.dataset.position - 6 >= 1
    assert "skipping prompt long.jsonl:2: 2203 tokens, longer than 2046 (the model's context 2048 less max_new_tokens 2)" in caplog.text
