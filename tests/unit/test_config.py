"""Config tree: defaults, YAML + overrides, strict errors, round trip, docs in sync."""

import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.config import Config, dump_yaml, load_config
from slipstream.config.docs import field_docs, render_reference
from slipstream.config import schema

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  lr: 3.0e-6\nrollout:\n  group_size: 4\n")
    cfg = load_config(recipe, ["actor.lr=1e-6", "rollout.stop=[';']", "algo.dual_clip_c=3", "model.path=null"])
    assert cfg.actor.lr == 1e-6  # command line wins over the recipe
    assert cfg.rollout.group_size == 4
    assert cfg.rollout.stop == [";"]
    assert cfg.algo.dual_clip_c == 3.0 and isinstance(cfg.algo.dual_clip_c, float)
    assert cfg.model.path is None
    assert cfg.trainer.total_steps == Config().trainer.total_steps


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.lrr=1", "unknown config key 'actor.lrr'; did you mean 'actor.lr'?"),
        ("rolout.group_size=2", "unknown config key 'rolout'; did you mean 'rollout'?"),
        ("rollout.group_size=abc", "rollout.group_size must be an integer, got 'abc'"),
        ("algo.loss_agg=token_mean", "did you mean 'token-mean'?"),
        ("trainer.resume=maybe", "trainer.resume must be true or false"),
        ("rollout.temperature=0", "rollout.temperature must be > 0"),
        ("algo.dual_clip_c=0.5", "algo.dual_clip_c must be > 1"),
        ("rollout.prompts_per_step=3", "must be divisible by algo.ppo_n_minibatches"),
        ("actor.lr", "must look like section.key=value"),
        ("actor.lr=0", "actor.lr must be > 0"),
        ("rollout.top_k=-1", "rollout.top_k must be >= 0"),
        ("reward.num_workers=-2", "reward.num_workers must be >= 0"),
        ("trainer.keep_last=0", "trainer.keep_last must be >= 1"),
        ("algo.behav_is_cap=0", "algo.behav_is_cap must be > 0"),
        ("algo.kl_clamp=0", "algo.kl_clamp must be > 0"),
        ("rollout.group_size=1", "rollout.group_size=1 with algo.advantage=grpo"),
        ("actor.lr.x=1", "'lr' is a value, not a section"),
    ],
)
def test_bad_values_name_the_key(override, message):
    overrides = [override]
    if "prompts_per_step" in override:
        overrides.append("algo.ppo_n_minibatches=2")
    if override == "actor.lr.x=1":
        overrides.insert(0, "actor.lr=1")
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_group_size_one_needs_an_estimator_without_groups():
    import torch

    from slipstream.algo.advantages import ADVANTAGE_FNS, get_advantage_fn

    with pytest.raises(ValueError, match="or algo.advantage=reinforce"):
        load_config(None, ["rollout.group_size=1", "algo.advantage=rloo"])
    assert load_config(None, ["rollout.group_size=1", "algo.advantage=reinforce"]).rollout.group_size == 1
    # the list tells the truth: exactly these estimators give 0 to every group of one
    rewards, groups = torch.tensor([0.0, 1.0, 3.0]), torch.arange(3)
    for name in ADVANTAGE_FNS:
        learns = bool(get_advantage_fn(name)(rewards, groups).abs().sum() > 0)
        assert learns == (name not in schema.GROUP_ADVANTAGES), name


def test_bad_recipe(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="bad.yaml:1:1: a recipe is a mapping of sections, got a list"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["actor.lr=2e-6", "reward.functions=[math, format]", "reward.weights=[1, 0.5]"])
    dump_yaml(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_every_field_documented():
    import dataclasses

    from slipstream.config import schema

    sections = [Config, schema.EvalSetSection]  # eval sets live in a dict: not reachable from the defaults
    while sections:
        cls = sections.pop()
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
        nested = (getattr(cls(), f.name) for f in dataclasses.fields(cls))
        sections += [type(value) for value in nested if dataclasses.is_dataclass(value)]


def test_moved_keys_name_their_new_place(tmp_path):
    for old, new in {"trainer.tensorboard=false": "logging.tensorboard", "trainer.log_every=5": "logging.log_every"}.items():
        with pytest.raises(ValueError, match=f"config key '{old.split('=')[0]}' moved to '{new}'"):
            load_config(None, [old])
    recipe = tmp_path / "old.yaml"
    recipe.write_text("trainer:\n  total_steps: 3\n  log_every: 5\n")
    with pytest.raises(ValueError, match=r"old.yaml:3:3: config key 'trainer.log_every' moved to 'logging.log_every'"):
        load_config(recipe)
    cfg = load_config(None, ["logging.wandb.enabled=true", "logging.wandb.mode=offline", "logging.wandb.tags=[a, b]"])
    assert cfg.logging.wandb.enabled and cfg.logging.wandb.mode == "offline" and cfg.logging.wandb.tags == ["a", "b"]
    assert not Config().logging.wandb.enabled  # off by default
    with pytest.raises(ValueError, match="logging.wandb.mode must be one of"):
        load_config(None, ["logging.wandb.mode=sometimes"])


def test_megatron_sizes_that_are_not_wired_are_rejected():
    for backend in ("megatron:p2", "megatron:t2c2"):
        with pytest.raises(ValueError, match="not wired into the megatron engine yet; use megatron:d<D>t<T>"):
            load_config(None, [f"actor.backend={backend}"])
    assert load_config(None, ["actor.backend=megatron:d1t1p1c1"]).actor.backend == "megatron:d1t1p1c1"
    assert "p<P>" not in render_reference() and "c<C>" not in render_reference()


def test_reference_doc_in_sync():
    on_disk = (ROOT / "docs" / "config.md").read_text()
    assert on_disk == render_reference(), "docs/config.md is stale: run python -m slipstream.config.docs > docs/config.md"


def test_recipes_load():
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        load_config(recipe)


def test_loading_a_config_imports_no_torch():
    # the CLI loads the config before its start-up: a Ctrl-C or a config error there must not wait for torch
    code = ("import sys; from slipstream.config import load_config; load_config('recipes/demo.yaml', []); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('slipstream'))")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
