"""perf/: FLOPs vs hand-computed values, MFU table, PhaseTimer, perf_metrics."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from slipstream.models.config import ModelConfig
from slipstream.perf import (
    PhaseTimer,
    device_peak_flops,
    flops_per_token,
    forward_flops,
    lookup_peak_flops,
    mfu,
    perf_metrics,
    train_flops,
)

# A tiny Qwen3-shaped model (the size unit tests build); N worked out by hand below.
TINY = ModelConfig(
    family="qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qk_norm=True,
)
QWEN3_1_7B = ModelConfig(
    family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True, qk_norm=True,
)


# ---------------------------------------------------------------- FLOPs


def test_tiny_matmul_params_by_hand():
    # q 32*32 + k,v 2*32*16 + o 32*32 + mlp 3*32*64 = 1024+1024+1024+6144 = 9216 per layer,
    # 2 layers + LM head 128*32 = 4096 -> 22528.
    assert TINY.num_matmul_params == 22528


def test_qwen3_1_7b_matmul_params_by_hand():
    # per layer: q 2048*2048 = 4,194,304; k+v 2*2048*1024 = 4,194,304; o 4,194,304;
    # mlp 3*2048*6144 = 37,748,736 -> 50,331,648; x28 = 1,409,286,144; LM head 151936*2048
    # = 311,164,928 (counted although tied: it is a matmul) -> 1,720,451,072.
    assert QWEN3_1_7B.num_matmul_params == 1_720_451_072


def test_matmul_params_match_transformers_linear_weights():
    # Independent check of N: sum of every nn.Linear weight in transformers' Qwen3 (LM head included).
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen3Config(
        vocab_size=TINY.vocab_size, hidden_size=TINY.hidden_size, intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers, num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads, head_dim=TINY.head_dim, tie_word_embeddings=False,
    )
    model = transformers.Qwen3ForCausalLM(hf_cfg)
    n_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert n_linear == TINY.num_matmul_params


def test_train_flops_tiny_by_hand():
    # 6*N*(10+20) + 6*L*H*d*(10^2+20^2) = 6*22528*30 + 6*2*4*8*500 = 4,055,040 + 192,000
    assert train_flops(TINY, [10, 20]) == 4_247_040.0
    # exact arithmetic: measured 0
    assert forward_flops(TINY, [10, 20]) == pytest.approx(4_247_040 / 3, rel=1e-15)
    assert train_flops(TINY, []) == 0.0
    # exact arithmetic: measured 0
    assert flops_per_token(TINY, 10) == pytest.approx((6 * 22528 * 10 + 6 * 2 * 4 * 8 * 100) / 10)


def test_train_flops_qwen3_1_7b_by_hand():
    # One 4096-token sample: dense 6 * 1,720,451,072 = 10,322,706,432 per token, * 4096
    # = 42,281,805,545,472; attention 6*28*16*128 = 344,064, * 4096^2 = 5,772,436,045,824.
    dense = 42_281_805_545_472
    attention = 5_772_436_045_824
    assert train_flops(QWEN3_1_7B, [4096]) == float(dense + attention)
    # Two samples: the attention term is quadratic per sample, not in the summed length.
    two = train_flops(QWEN3_1_7B, [1024, 3072])
    assert two == float(6 * 1_720_451_072 * 4096 + 6 * 28 * 16 * 128 * (1024**2 + 3072**2))
    assert two < train_flops(QWEN3_1_7B, [4096])


def test_train_flops_tiny_preset_by_hand():
    presets = pytest.importorskip("slipstream.models.presets")
    tiny = presets.get_preset("tiny")
    shape = (tiny.vocab_size, tiny.hidden_size, tiny.intermediate_size, tiny.num_layers,
             tiny.num_heads, tiny.num_kv_heads, tiny.head_dim)
    assert shape == (96, 64, 128, 2, 4, 2, 16), "tiny preset changed: redo the hand values below"
    # per layer: q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*128 = 4096*3 + 24576 = 36864;
    # 2 layers + LM head 96*64 = 6144 -> N = 79872.
    assert tiny.num_matmul_params == 79872
    # [16, 48]: 6*79872*64 = 30,670,848; 6*2*4*16*(16^2+48^2) = 768*2560 = 1,966,080.
    assert train_flops(tiny, [16, 48]) == 32_636_928.0


def test_train_flops_rejects_negative_length():
    with pytest.raises(ValueError, match=">= 0"):
        train_flops(TINY, [3, -1])


# ---------------------------------------------------------------- MFU


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA GeForce RTX 2080", None),
    ],
)
def test_peak_lookup(name, peak):
    assert lookup_peak_flops(name) == peak


def test_device_peak_flops_override_and_unknown(caplog):
    assert device_peak_flops("NVIDIA H200") == 989e12
    assert device_peak_flops("NVIDIA H200", override=500e12) == 500e12
    assert device_peak_flops("Some Future GPU", override=1e15) == 1e15
    with caplog.at_level(logging.WARNING, logger="slipstream.perf.mfu"):
        assert device_peak_flops("Some Future GPU") is None
        assert device_peak_flops("cpu") is None
    assert "Some Future GPU" in caplog.text and "CPU" in caplog.text
    assert all("trainer.peak_flops" in r.getMessage() for r in caplog.records)  # the warning names the fix
    with pytest.raises(ValueError, match="positive"):
        device_peak_flops("NVIDIA H200", override=0.0)


def test_mfu():
    # 989e12 FLOPs in 2 s on a 989e12 peak -> 50%.
    # exact arithmetic: measured 0
    assert mfu(989e12, 2.0, 989e12) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mfu(1.0, 0.0, 989e12)


# ---------------------------------------------------------------- PhaseTimer


def test_phase_timer_accumulates():
    timer = PhaseTimer("cpu")
    with timer.phase("step"):
        for _ in range(2):
            with timer.phase("rollout"):
                time.sleep(0.02)
        with timer.phase("actor_train"):
            time.sleep(0.01)
    times = timer.times
    assert 0.04 <= times["rollout"] < 0.2
    assert 0.01 <= times["actor_train"] < 0.1
    assert times["step"] >= times["rollout"] + times["actor_train"]
    summary = timer.summary()
    assert set(summary) == {"perf/step_time", "perf/rollout_time", "perf/actor_train_time"}
    assert summary["perf/rollout_time"] == times["rollout"]
    timer.reset()
    assert timer.summary() == {}


def test_phase_timer_records_time_when_body_raises():
    timer = PhaseTimer()
    with pytest.raises(KeyError):
        with timer.phase("reward"):
            raise KeyError("boom")
    assert "reward" in timer.times
    with pytest.raises(ValueError):
        with timer.phase("a"):
            with timer.phase("a"):
                pass


class FakeProbe:
    """Stands in for the CUDA allocator: tests the peak bookkeeping on the CPU."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self.syncs = 0

    def alloc(self, num_bytes):
        self.current += num_bytes
        self.peak = max(self.peak, self.current)

    def free(self, num_bytes):
        self.current -= num_bytes

    def synchronize(self):
        self.syncs += 1

    def reset_peak(self):
        self.peak = self.current

    def peak_bytes(self):
        return self.peak


def test_phase_timer_peak_memory_per_phase_with_nesting():
    gib = 2**30
    probe = FakeProbe()
    timer = PhaseTimer(probe=probe)
    with timer.phase("step"):
        probe.alloc(1 * gib)  # weights
        with timer.phase("rollout"):
            probe.alloc(5 * gib)  # KV cache, freed at the end of the phase
            probe.free(5 * gib)
        with timer.phase("actor_train"):
            probe.alloc(2 * gib)
            probe.free(2 * gib)
    s = timer.summary()
    # Each phase's own peak, not polluted by the previous one (peak reset at phase start) ...
    # exact arithmetic: measured 0
    assert s["perf/max_memory_allocated_gb/rollout"] == pytest.approx(6.0)
    # exact arithmetic: measured 0
    assert s["perf/max_memory_allocated_gb/actor_train"] == pytest.approx(3.0)
    # ... while the enclosing step still sees the highest peak inside it.
    # exact arithmetic: measured 0
    assert s["perf/max_memory_allocated_gb/step"] == pytest.approx(6.0)
    # Two syncs per phase (enter, exit), and nowhere else.
    assert probe.syncs == 6


def test_phase_timer_cpu_has_no_memory_metrics():
    timer = PhaseTimer("cpu")
    with timer.phase("rollout"):
        pass
    assert not any("memory" in key for key in timer.summary())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_phase_timer_cuda_memory():
    timer = PhaseTimer("cuda")
    with timer.phase("actor_train"):
        x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 0.25 GiB
        del x
    assert timer.summary()["perf/max_memory_allocated_gb/actor_train"] >= 0.25


# ---------------------------------------------------------------- perf_metrics


def test_perf_metrics_by_hand():
    seq_lens = [10, 20]  # train_flops(TINY) = 4,247,040 (see above), 30 tokens
    times = {
        "step": 10.0, "rollout": 4.0, "reward": 1.0, "old_log_probs": 0.5,
        "ref_log_probs": 0.25, "actor_train": 2.0, "update_weights": 0.25,
    }
    # Keyword form, as the controller calls it.
    out = perf_metrics(TINY, seq_lens=seq_lens, times=times, world_size=2, peak_flops=1e6, response_lens=[4, 8, 12])
    # exact arithmetic: measured 0
    assert out["perf/peak_tflops"] == pytest.approx(1e-6)
    # per GPU: 4,247,040 / 2 / 2 s = 1,061,760 FLOP/s
    # exact arithmetic: measured 0
    assert out["perf/actor_train_tflops"] == pytest.approx(1_061_760 / 1e12)
    # exact arithmetic: measured 0
    assert out["perf/actor_train_mfu"] == pytest.approx(1.06176)
    # exact arithmetic: measured 0
    assert out["perf/actor_train_tok_per_s"] == pytest.approx(30 / 2 / 2.0)
    # forward = 1,415,680 FLOPs; / 2 GPUs / 0.5 s and / 0.25 s
    # exact arithmetic: measured 0
    assert out["perf/log_probs_tflops"] == pytest.approx(1_415_680 / 2 / 0.5 / 1e12)
    # exact arithmetic: measured 0
    assert out["perf/ref_log_probs_tflops"] == pytest.approx(1_415_680 / 2 / 0.25 / 1e12)
    # trainer busy 0.5 + 0.25 + 2 + 0.25 = 3 of 10 s -> idle 70%
    # exact arithmetic: measured 0
    assert out["perf/wait_time_ratio"] == pytest.approx(0.7)
    # 24 response tokens / 4 s / 2 GPUs; longest 12 / 4 s
    # exact arithmetic: measured 0
    assert out["perf/rollout_tokens_per_gpu_per_s"] == pytest.approx(3.0)
    # exact arithmetic: measured 0
    assert out["perf/longest_sample_tokens_per_s"] == pytest.approx(3.0)


def test_perf_metrics_partial_inputs():
    # No peak, no rollout, two PPO passes, separate rollout GPUs not used: only what can be computed.
    out = perf_metrics(TINY, [10, 20], {"actor_train": 1.0}, train_passes=2)
    assert set(out) == {"perf/actor_train_tflops", "perf/actor_train_tok_per_s"}
    # exact arithmetic: measured 0
    assert out["perf/actor_train_tok_per_s"] == pytest.approx(60.0)
    out = perf_metrics(TINY, [], {"rollout": 2.0, "step": 2.5, "actor_train": 3.0}, response_lens=[6], rollout_num_gpus=3)
    # exact arithmetic: measured 0
    assert out["perf/rollout_tokens_per_gpu_per_s"] == pytest.approx(1.0)
    assert out["perf/wait_time_ratio"] == 0.0  # clamped: phases timed apart from the step
    with pytest.raises(ValueError, match="world_size"):
        perf_metrics(TINY, [10], {"actor_train": 1.0}, world_size=0)
