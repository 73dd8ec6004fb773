"""The rollout's kernel settings are config fields only: each one reaches the model runner, none is read from the
environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from slipstream.config import load_config
from slipstream.config.schema import RolloutSection
from slipstream.controller.setup import build_rollout
from slipstream.models.presets import get_preset
from slipstream.ops import decode_attention
from slipstream.rollout import model_runner
from slipstream.rollout.base import SamplingParams

PACKAGE = Path(__file__).resolve().parents[2] / "slipstream"
KERNEL_FIELDS = {  # rollout field (the runner's attribute of the same name) -> (a value other than the default, as the runner holds it)
    "layer_kernels": (False, False),
    "fused_lm_head": (True, True),
    "decode_launch": ("128,8,3,0", {"block_n": 128, "num_warps": 8, "num_stages": 3, "heads_first": 0,
                                    "longest_first": 1}),  # fmt: skip
    "decode_programs_per_sm": (3, 3),
}


def test_default_launch_is_the_kernels_default():
    text = RolloutSection().decode_launch
    assert decode_attention.parse_launch(text) == decode_attention.LAUNCH
    assert decode_attention.launch_text(decode_attention.LAUNCH) == text
    assert RolloutSection().decode_programs_per_sm == decode_attention.PROGRAMS_PER_SM


@pytest.mark.parametrize("text", ["64,4,4,1,1", "128,8,3", "32,2,1,0", "16,1,2,1,0"])
def test_decode_launch_text_round_trips(text):
    launch = decode_attention.parse_launch(text)
    assert decode_attention.parse_launch(decode_attention.launch_text(launch)) == launch
    assert decode_attention.launch_text(launch).startswith(text)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.decode_launch=64,4", r"rollout.decode_launch: a decode launch is block_n,num_warps,num_stages"),
        ("rollout.decode_launch=fast", r"rollout.decode_launch: .*got 'fast'"),
        ("rollout.decode_launch=100,4,4", r"rollout.decode_launch: .*power-of-two block_n"),
        ("rollout.decode_programs_per_sm=0", r"rollout.decode_programs_per_sm must be >= 1"),
    ],
)
def test_bad_kernel_settings_name_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_every_kernel_field_reaches_the_runner(monkeypatch):
    """Set through the config (as a recipe or the command line does), each field arrives in the model runner of the
    engine the trainer builds, and the decode launch and split target reach the attention op of every layer."""
    overrides = [f"rollout.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, (v, _) in KERNEL_FIELDS.items()]
    cfg = load_config(None, overrides)
    calls = []
    real = model_runner.cache_attention
    monkeypatch.setattr(model_runner, "cache_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    engine = build_rollout(cfg, get_preset("tiny"), torch.device("cpu"), torch.float32)
    for field, (_, held) in KERNEL_FIELDS.items():
        assert getattr(engine.runner, field) == held, field
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, n=2), keys=[0])
    assert calls and all(kw["launch"] == KERNEL_FIELDS["decode_launch"][1] for kw in calls)
    assert all(kw["programs_per_sm"] == 3 for kw in calls)


def test_layer_kernels_off_takes_the_module_path():
    cfg = load_config(None, ["rollout.layer_kernels=false", "rollout.compile=false"])
    engine = build_rollout(cfg, get_preset("tiny"), torch.device("cpu"), torch.float32)
    assert not engine.runner.layer_kernels
    assert engine.runner._pre is model_runner._pre_attention  # the plain layer halves, uncompiled


def test_no_kernel_switch_is_read_from_the_environment():
    names = ("SLIPSTREAM_LAYER_KERNELS", "SLIPSTREAM_FUSED_LM_HEAD", "SLIPSTREAM_DECODE_LAUNCH",
             "SLIPSTREAM_DECODE_PROGRAMS_PER_SM")  # fmt: skip
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in PACKAGE.rglob("*.py")
        for name in names
        if name in path.read_text()
    ]
    assert found == []
    # and the ops modules read no environment variable other than triton's interpreter switch
    for module in ("decode_attention", "layer_kernels", "sampling", "attention"):
        source = (PACKAGE / "ops" / f"{module}.py").read_text()
        assert re.findall(r"os\.environ|getenv", source) == [], module
