"""The async loop on the CPU: staleness bound from per-token versions, eta = 0 equals sync, exact prompt
accounting across a crash + resume, and dynamic sampling (the demo recipe, a few steps each)."""

from __future__ import annotations

import pytest
import torch

from slipstream.config import load_config
from slipstream.controller.trainer import RLTrainer

BASE = ("logging.tensorboard=false", "trainer.export_hf=false", "logging.log_every=1000", "algo.decoupled=true")


def _trainer(run_dir, *overrides: str) -> RLTrainer:
    return RLTrainer(load_config("recipes/demo.yaml", [f"trainer.run_dir={run_dir}", *BASE, *overrides]))


def _record_batches(trainer: RLTrainer) -> list[tuple[int, list]]:
    """(trainer version, samples) of every batch the trainer packs, in order."""
    seen: list[tuple[int, list]] = []
    make_batch = trainer.stages.make_batch

    def recording(samples, fresh_version=None):
        seen.append((trainer.step_num, list(samples)))
        return make_batch(samples, fresh_version)

    trainer.stages.make_batch = recording
    return seen


def _run(trainer: RLTrainer, steps: int) -> list[dict]:
    metrics = []
    log = trainer.logger.log
    # step rows only (the demo's eval records are logged too)
    trainer.logger.log = lambda step, m: (metrics.append(m) if "reward/mean" in m else None, log(step, m))
    trainer.cfg.trainer.total_steps = steps
    trainer.fit()
    return metrics


# longer responses, several decode rings each: the async run queues each ring before reading the last
OVERLAPPED = (("rollout.max_new_tokens=6", "rollout.decode_steps_per_sync=2"), ("rollout.overlap_decode=true",))


@pytest.mark.parametrize("both, async_only", [((), ()), OVERLAPPED])
def test_async_with_zero_staleness_equals_sync(tmp_path, both, async_only):
    runs = {}
    for mode in ("sync", "async"):
        extra = (*both, *async_only) if mode == "async" else both
        trainer = _trainer(tmp_path / mode, f"trainer.mode={mode}", "trainer.max_staleness=0", *extra)
        batches = _record_batches(trainer)
        metrics = _run(trainer, 4)
        weights = {n: t.clone() for n, t in trainer.engine.export_weights()}
        runs[mode] = (batches, metrics, weights)
    (sb, sm, sw), (ab, am, aw) = runs["sync"], runs["async"]
    for (sv, s_samples), (av, a_samples) in zip(sb, ab, strict=True):
        assert sv == av
        assert [(s.prompt_index, s.response_ids, s.behav_logprobs, s.token_versions) for s in s_samples] == \
            [(s.prompt_index, s.response_ids, s.behav_logprobs, s.token_versions) for s in a_samples]  # fmt: skip
    for s_row, a_row in zip(sm, am, strict=True):
        for key in s_row:
            if key.startswith(("reward/", "actor/")):
                assert a_row[key] == s_row[key], key  # same samples, same losses, bit for bit
    for name in sw:
        assert torch.equal(sw[name], aw[name]), name


@pytest.mark.parametrize("eta", [1, 2])
def test_no_trained_token_is_staler_than_max_staleness(tmp_path, eta):
    trainer = _trainer(tmp_path, "trainer.mode=async", f"trainer.max_staleness={eta}")
    batches = _record_batches(trainer)
    metrics = _run(trainer, 5)
    lags = [version - v for version, samples in batches for s in samples for v in s.token_versions]
    assert max(lags) <= eta
    # the producer runs as far ahead as allowed (one-token responses: generation is instant), so a bound
    # that were one too loose would show here as lag eta + 1, and one too tight would never reach eta
    assert max(lags) == eta and min(lags) >= 0
    assert max(m["async/staleness_max"] for m in metrics) == eta
    assert all(m["async/dropped_stale"] == 0 for m in metrics)
    # each step trains the next prompts of the stream, exactly once
    indices = [s.prompt_index for _, samples in batches for s in samples[:: trainer.cfg.rollout.group_size]]
    assert indices == list(range(5 * trainer.cfg.rollout.prompts_per_step))


def test_overlapped_decode_in_the_async_loop_keeps_versions_and_the_bound(tmp_path):
    """Several decode rings per response, queued ahead (rollout.overlap_decode), with weight syncs landing
    between engine steps while a ring is queued: every token carries the version that sampled it, none is
    staler than the bound, versions never go down within a response, and no prompt is lost or repeated."""
    trainer = _trainer(tmp_path, "trainer.mode=async", "trainer.max_staleness=1", *OVERLAPPED[0], *OVERLAPPED[1])
    batches = _record_batches(trainer)
    _run(trainer, 4)
    lags = [version - v for version, samples in batches for s in samples for v in s.token_versions]
    assert 0 <= min(lags) and max(lags) <= 1
    assert all(list(s.token_versions) == sorted(s.token_versions) for _, samples in batches for s in samples)
    assert max(len(s.response_ids) for _, samples in batches for s in samples) > 2  # more than one ring
    indices = [s.prompt_index for _, samples in batches for s in samples[:: trainer.cfg.rollout.group_size]]
    assert indices == list(range(4 * trainer.cfg.rollout.prompts_per_step))


def test_async_crash_and_resume_loses_and_repeats_no_prompt(tmp_path):
    """A checkpoint at step 2 with later batches in flight; the run dies in step 3; the resumed run
    trains steps 3 and 4 on exactly the prompts the first run had not trained."""
    first = _trainer(tmp_path, "trainer.mode=async", "trainer.max_staleness=2", "trainer.save_every=2")
    trained = _record_batches(first)
    train = first.stages.train

    def crash_in_step_3(batch, step_num):
        if step_num == 2:
            raise RuntimeError("simulated crash")
        return train(batch, step_num)

    first.stages.train = crash_in_step_3
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(first, 4)
    first_steps = [(v, samples) for v, samples in trained[:2]]  # steps 1 and 2 completed before the crash
    second = _trainer(tmp_path, "trainer.mode=async", "trainer.max_staleness=2", "trainer.save_every=2")
    assert second.step_num == 2
    resumed = _record_batches(second)
    _run(second, 4)
    groups = second.cfg.rollout.group_size
    indices = [s.prompt_index for _, samples in first_steps + resumed for s in samples[::groups]]
    assert indices == list(range(4 * second.cfg.rollout.prompts_per_step))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dynamic_sampling_never_trains_a_zero_advantage_group(tmp_path, mode):
    trainer = _trainer(tmp_path, f"trainer.mode={mode}", "algo.dynamic_sampling=true",
                       "algo.dynamic_sampling_max_prompts=512")  # fmt: skip
    batches = _record_batches(trainer)
    metrics = _run(trainer, 3)
    groups_per_step = trainer.cfg.rollout.prompts_per_step
    assert sum(m["async/dropped_zero_adv_groups"] for m in metrics) > 0  # at chance most groups score all 0
    for _, samples in batches:
        groups: dict[int, set] = {}
        for s in samples:
            groups.setdefault(s.group_id, set()).add(s.reward)
        assert len(groups) == groups_per_step
        assert all(len(rewards) > 1 for rewards in groups.values())


@pytest.mark.parametrize("max_prompts", [3, 512])
def test_dynamic_sampling_keeps_the_same_groups_in_sync_and_async(tmp_path, max_prompts):
    """One implementation filters both loops: at max_staleness 0 the async producer (groups filed as they
    finish) keeps the groups the sync loop keeps (a whole batch at a time), replacements and ids included,
    whether or not the extra-prompt limit is reached; unused spare prompts carry over to the next step."""
    kept = {}
    for mode in ("sync", "async"):
        trainer = _trainer(tmp_path / mode, f"trainer.mode={mode}", "trainer.max_staleness=0",
                           "algo.dynamic_sampling=true", f"algo.dynamic_sampling_max_prompts={max_prompts}")  # fmt: skip
        batches = _record_batches(trainer)
        metrics = _run(trainer, 3)
        kept[mode] = (
            [[(s.group_id, s.prompt_index, s.response_ids, s.reward) for s in samples] for _, samples in batches],
            [(m["async/dropped_zero_adv_groups"], m["async/extra_prompts"]) for m in metrics],
        )
    assert kept["sync"] == kept["async"]
    extra = [e for _, e in kept["sync"][1]]
    assert sum(extra) > 0
    if max_prompts == 3:  # the limit is reached: the zero-advantage groups past it are trained, batches stay full
        assert max(extra) == 3
        assert all(len({gid for gid, *_ in batch}) == trainer.cfg.rollout.prompts_per_step for batch in kept["sync"][0])


def test_default_settings_at_zero_staleness_equal_sync(tmp_path):
    """With algo.decoupled left at its default, async at max_staleness 0 trains the sync loss (every token
    comes from the current weights, so there is no stale behaviour policy to correct for): same metrics
    and weights bit for bit, not only the same samples."""
    runs = {}
    for mode in ("sync", "async"):
        overrides = [f"trainer.run_dir={tmp_path / mode}", *(b for b in BASE if not b.startswith("algo.decoupled")),
                     f"trainer.mode={mode}", "trainer.max_staleness=0"]
        trainer = RLTrainer(load_config("recipes/demo.yaml", overrides))
        runs[mode] = (_run(trainer, 3), {n: t.clone() for n, t in trainer.engine.export_weights()})
    (sm, sw), (am, aw) = runs["sync"], runs["async"]
    for s_row, a_row in zip(sm, am, strict=True):
        for key in s_row:
            if key.startswith(("reward/", "actor/")):
                assert a_row[key] == s_row[key], key
    for name in sw:
        assert torch.equal(sw[name], aw[name]), name
