"""`slipstream bench rollout`: the workloads, the bandwidth bound, and the decode-launch override."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.bench.rollout import RolloutCase, bound_tok_per_s, decode_idle, nanovllm_case, w1_case
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer
from slipstream.ops import decode_attention
from slipstream.rollout.kv_cache import kv_bytes_per_token
from slipstream.rollout.model_runner import ModelRunner


def test_nanovllm_case_draws_nano_vllms_requests():
    case = nanovllm_case()
    assert len(case.prompts) == 256 and case.num_samples == 256
    assert case.response_tokens == 133_966  # the total nano-vllm's bench.py generates with random.seed(0)
    assert all(100 <= len(p) <= 1024 and 0 <= min(p) and max(p) <= 10_000 for p in case.prompts)
    assert all(100 <= b <= 1024 for (b,) in case.budgets)


def test_w1_case_has_w1s_budgets():
    case = w1_case()
    budgets = sorted(b for group in case.budgets for b in group)
    assert case.num_samples == 64 and budgets[0] == 256 and budgets[-1] == 3584
    assert {len(p) for p in case.prompts} == {512}


def test_bound_is_the_step_by_step_byte_sum():
    cfg = dataclasses.replace(get_preset("tiny"), num_layers=2)
    case = RolloutCase("two", [[1] * 5, [2] * 9], [[3, 1], [4]])
    weights = sum(p.numel() for p in Transformer(cfg).parameters()) * 2  # bf16
    kv = kv_bytes_per_token(cfg, torch.bfloat16)
    # every step reads the weights once and, for each sample still generating, its context so far
    total = 0
    for step in range(4):
        live = [(len(p), r) for p, group in zip(case.prompts, case.budgets) for r in group if step < r]
        total += weights + sum((prompt + step) * kv for prompt, _ in live)
    bandwidth = 1e12
    assert bound_tok_per_s(cfg, case, bandwidth) == pytest.approx(case.response_tokens / (total / bandwidth))


def test_h200_bounds_of_the_nanovllm_workload_are_the_issues():
    # the figures the rollout goals are stated against: 42.6k (qwen3-0.6b) and 37.0k tok/s (qwen3-1.7b)
    case = nanovllm_case()
    assert bound_tok_per_s(get_preset("qwen3-0.6b"), case, 4.8e12) == pytest.approx(42_600, rel=2e-3)
    assert bound_tok_per_s(get_preset("qwen3-1.7b"), case, 4.8e12) == pytest.approx(37_000, rel=2e-3)


def test_decode_launch_text():
    assert decode_attention.parse_launch("128,8,3") == {"block_n": 128, "num_warps": 8, "num_stages": 3,
                                                         "heads_first": 1, "longest_first": 1}  # fmt: skip
    launch = decode_attention.parse_launch("64,4,4,0")
    assert launch["num_stages"] == 4 and launch["heads_first"] == 0
    launch = decode_attention.parse_launch("64,4,4,1,0")
    assert launch["longest_first"] == 0
    assert decode_attention.launch_text(launch) == "64,4,4,1,0"
    assert decode_attention.launch_order(torch.tensor([3, 9], dtype=torch.int32), launch) is None  # order as is
    lengths = torch.tensor([5, 900, 17, 900, 64], dtype=torch.int32)
    order = decode_attention.launch_order(lengths, decode_attention.parse_launch("64,4,4,1,1"))
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(5))
    assert lengths[order].tolist() == [900, 900, 64, 17, 5]
    for bad in ("64,4", "64,4,2,1,0,7", "64,four,2", "48,4,2", "64,0,2", "64,4,2,2", ""):
        with pytest.raises(ValueError, match="block_n,num_warps,num_stages"):
            decode_attention.parse_launch(bad)


def test_decode_idle_is_the_decode_wall_time_without_device_work():
    assert decode_idle({"decode_s": 5.0, "decode_device_s": 4.5}) == pytest.approx(0.1)
    assert decode_idle({"decode_s": 5.0, "decode_device_s": None}) is None  # no CUDA graphs: not measured
    assert decode_idle({"decode_s": 0.0, "decode_device_s": 0.0}) is None


@pytest.mark.parametrize("flags, overlap", [([], True), (["--no-overlap-decode"], False)])
def test_overlap_decode_setting_reaches_the_engine(tmp_path, flags, overlap):
    """Overlapped decode rings by default, `--no-overlap-decode` off, on the CPU (tiny preset, eager): the row
    records it and generates every budgeted token (run_builtin checks the count), first and repeated call alike."""
    import json

    from slipstream.cli import main

    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--preset", "tiny", "--device", "cpu", "--no-compile", "--no-cuda-graphs", "--batch",
            "4", "--group", "2", "--prompt-len", "16", "--new-tokens", "8", "--steps-per-sync", "3", *flags,
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["call"] for r in rows] == ["first", "repeat"]
    assert all(r["settings"]["overlap_decode"] == overlap and r["response_tokens"] == 4 * 8 for r in rows)
    assert all(r["decode_steps"] == 8 - 1 for r in rows)  # the prefill samples the first token; 3 + 3 + 1 after


def test_kernel_flags_set_the_rollout_fields(tmp_path, monkeypatch):
    """--no-layer-kernels, --fused-lm-head, --decode-launch and --decode-programs-per-sm reach the engine's model
    runner as the rollout section's fields; a bad launch is the field's error, not a traceback."""
    from slipstream.cli import main
    from slipstream.rollout import builtin

    runners = []
    monkeypatch.setattr(builtin, "ModelRunner", lambda *a, **kw: runners.append(kw) or ModelRunner(*a, **kw))
    argv = ["bench", "rollout", "--preset", "tiny", "--device", "cpu", "--no-compile", "--no-cuda-graphs",
            "--batch", "2", "--group", "2", "--prompt-len", "4", "--new-tokens", "2", "--out", str(tmp_path / "r.json")]  # fmt: skip
    assert main(argv) == 0
    assert runners[-1] == {"compile": False, "cuda_graphs": False, "decode_attention": "triton",
                           "layer_kernels": True, "fused_lm_head": False, "decode_launch": "64,4,4,1,1",
                           "decode_programs_per_sm": 8}  # fmt: skip
    flags = ["--no-layer-kernels", "--fused-lm-head", "--decode-launch", "128,8,3", "--decode-programs-per-sm", "2"]
    assert main(argv + flags) == 0
    got = {k: runners[-1][k] for k in ("layer_kernels", "fused_lm_head", "decode_launch", "decode_programs_per_sm")}
    assert got == {"layer_kernels": False, "fused_lm_head": True, "decode_launch": "128,8,3",
                   "decode_programs_per_sm": 2}
    assert main(argv + ["--decode-launch", "128,8"]) == 2
    assert main(argv + ["--decode-programs-per-sm", "0"]) == 2
