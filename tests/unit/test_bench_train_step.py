"""CPU tests of `slipstream bench train-step`: workloads, result schema, FLOPs accounting, naive cross-check."""

from __future__ import annotations

import argparse

import pytest
import torch

from slipstream.bench import naive
from slipstream.bench.cli import add_bench_parser
from slipstream.bench.train_step import bench_train_step, logprob_memory_check, memory_curve
from slipstream.bench.workloads import W1_TOTAL_TOKENS, WORKLOADS, get_workload, make_lengths, scaled, synthetic_batch
from slipstream.models.presets import get_preset


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- workloads


def test_w1_lengths_total_and_determinism():
    lengths = make_lengths(WORKLOADS["W1"])
    assert len(lengths) == 64
    assert sum(p + r for p, r in lengths) == W1_TOTAL_TOKENS == 155_648
    assert all(p == 512 for p, _ in lengths)
    # Responses are the rounded linspace(256, 3584, 64), shuffled.
    responses = [r for _, r in lengths]
    expected = [round(256 + i * (3584 - 256) / 63) for i in range(64)]
    assert sorted(responses) == expected
    assert responses != expected
    assert make_lengths(WORKLOADS["W1"]) == lengths
    for name, preset in (("W1-0.6b", "qwen3-0.6b"), ("W1-4b", "qwen3-4b"), ("W1-8b", "qwen3-8b")):
        assert WORKLOADS[name].preset == preset
        assert make_lengths(WORKLOADS[name]) == lengths
    assert get_workload("W1", preset="qwen3-0.6b").preset == "qwen3-0.6b"
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("W9")


def test_scaled_workload_keeps_the_per_rank_distribution():
    """--scale K: K x the sequences, the same spread of lengths (W1's per-GPU work on K GPUs)."""
    w4 = scaled(WORKLOADS["W1"], 4)
    assert (w4.name, w4.num_seqs) == ("W1x4", 256)
    lengths = make_lengths(w4)
    assert all(p == 512 for p, _ in lengths)
    tokens = sum(p + r for p, r in lengths)
    assert abs(tokens / 4 - W1_TOTAL_TOKENS) < 0.001 * W1_TOTAL_TOKENS
    assert min(r for _, r in lengths) == 256 and max(r for _, r in lengths) == 3584
    assert scaled(WORKLOADS["W1"], 1) is WORKLOADS["W1"]
    with pytest.raises(ValueError, match="scale"):
        scaled(WORKLOADS["W1"], 0)


def test_synthetic_batch_shapes_and_masks():
    w = WORKLOADS["tiny"]
    vocab = get_preset(w.preset).vocab_size
    lengths = make_lengths(w)
    batch = synthetic_batch(w, vocab)
    assert batch.num_seqs == w.num_seqs == 8
    assert batch.seq_lens() == [p + r for p, r in lengths]
    assert int(batch.input_ids.max()) < vocab and int(batch.input_ids.min()) >= 0
    assert int(batch.loss_mask.sum()) == sum(r for _, r in lengths)
    cu = batch.cu_seqlens.tolist()
    for i, (p, r) in enumerate(lengths):
        mask = batch.loss_mask[cu[i] : cu[i + 1]]
        # positions P-1 .. P+R-2 predict the response tokens
        assert mask.nonzero().flatten().tolist() == list(range(p - 1, p + r - 1))
        adv = batch.advantages[cu[i] : cu[i + 1]][mask]
        assert torch.all(adv == adv[0])
    off = ~batch.loss_mask
    assert torch.all(batch.advantages[off] == 0) and torch.all(batch.old_logprobs[off] == 0)
    on = batch.loss_mask
    # old != behaviour on loss tokens (the ratio path is exercised), both near -log(V)
    assert not torch.equal(batch.old_logprobs[on], batch.behav_logprobs[on])
    assert abs(float(batch.old_logprobs[on].mean()) + torch.log(torch.tensor(float(vocab)))) < 0.1
    # group-normalised advantages: zero mean per group
    seq_adv = torch.stack([batch.advantages[cu[i] : cu[i + 1]][batch.loss_mask[cu[i] : cu[i + 1]]][0] for i in range(8)])
    # measured 3.0e-08 (fp32 group means): 3x margin
    assert torch.allclose(seq_adv.view(2, 4).mean(1), torch.zeros(2), atol=1e-7)
    again = synthetic_batch(w, vocab)
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.old_logprobs, batch.old_logprobs)


# ---------------------------------------------------------------- slipstream bench


def _hand_train_flops(lens: list[int]) -> float:
    """The FLOPs formula of docs/architecture.md#tokens-flops-and-mfu written out from the tiny preset's fields (no slipstream.perf code)."""
    c = get_preset("tiny")
    h, d = c.hidden_size, c.head_dim
    # q, k + v, o projections and the three SwiGLU matrices, per layer; plus the LM head
    per_layer = h * c.num_heads * d + 2 * h * c.num_kv_heads * d + c.num_heads * d * h + 3 * h * c.intermediate_size
    n_matmul = c.num_layers * per_layer + c.vocab_size * h
    return 6 * n_matmul * sum(lens) + 6 * c.num_layers * c.num_heads * d * sum(s * s for s in lens)


@pytest.fixture(scope="module")
def tiny_result():
    torch.set_num_threads(1)
    return bench_train_step("tiny", max_tokens_per_mb=128, dtype=torch.float32, repeats=2, warmup=1, device="cpu")


def test_bench_schema_and_positive_numbers(tiny_result):
    r = tiny_result
    assert r["kind"] == "train_step" and r["config"]["backend"] == "local"
    lens = [p + q for p, q in make_lengths(WORKLOADS["tiny"])]
    assert r["workload"]["seq_lens"] == lens and r["workload"]["num_tokens"] == sum(lens)
    mb = r["micro_batches"]
    assert mb["count"] == len(mb["tokens"]) >= 2  # 264 tokens under a 128-token cap
    assert sum(mb["tokens"]) == sum(lens) and max(mb["tokens"]) <= 128
    assert sum(mb["num_seqs"]) == len(lens)
    for phase in ("actor_train", "log_probs"):
        p = r["phases"][phase]
        assert len(p["times_s"]) == 2
        assert 0 < p["time_min_s"] <= p["time_s"] <= p["time_max_s"]
        assert p["tok_per_s"] > 0 and p["tflops"] > 0
        assert p["mfu"] is None and p["peak_memory_gib"] is None  # CPU: no peak, no CUDA memory
    assert r["metrics"]["perf/actor_train_time"] == r["phases"]["actor_train"]["time_s"]
    assert "perf/log_probs_tflops" in r["metrics"]
    assert r["train_metrics"]["actor/num_micro_batches"] == mb["count"]
    assert r["env"]["torch"] == torch.__version__ and "command" in r["env"]


def test_bench_flops_and_tokens_accounting(tiny_result):
    lens = tiny_result["workload"]["seq_lens"]
    train, fwd = tiny_result["phases"]["actor_train"], tiny_result["phases"]["log_probs"]
    expected = _hand_train_flops(lens)
    assert train["flops"] == expected
    # exact arithmetic: measured 0
    assert fwd["flops"] == pytest.approx(expected / 3, rel=1e-12)
    assert train["tokens"] == fwd["tokens"] == 264
    # exact arithmetic: measured 0
    assert train["tok_per_s"] == pytest.approx(264 / train["time_s"], rel=1e-12)
    # exact arithmetic: measured 0
    assert train["tflops"] == pytest.approx(expected / train["time_s"] / 1e12, rel=1e-12)
    # one optimizer step per timed actor update: loss tokens counted over the whole minibatch
    assert tiny_result["train_metrics"]["actor/num_loss_tokens"] == sum(r for _, r in make_lengths(WORKLOADS["tiny"]))


def test_bench_mfu_with_peak_override():
    r = bench_train_step(
        "tiny", max_tokens_per_mb=512, dtype=torch.float32, repeats=1, warmup=0, device="cpu", peak_flops=1e12
    )
    p = r["phases"]["actor_train"]
    assert r["micro_batches"]["count"] == 1
    # exact arithmetic: measured 0
    assert p["mfu"] == pytest.approx(p["flops"] / p["time_s"] / 1e12, rel=1e-12)


def test_memory_curve_and_logprob_check_run_on_cpu():
    curve = memory_curve("tiny", [32, 96], seq_len=40, dtype=torch.float32, device="cpu")
    assert [p["tokens"] for p in curve["points"]] == [32, 96]
    assert all(p["status"] == "ok" and p["time_s"] > 0 for p in curve["points"])
    assert curve["largest_fitting_tokens"] == 96
    check = logprob_memory_check(256, 500, 16, dtype=torch.float32, device="cpu", check_rows=64)
    assert check["max_abs_err_vs_fp64"] < 1e-4
    # exact arithmetic: measured 0
    assert check["naive_logits_fp32_gib"] == pytest.approx(256 * 500 * 4 / 2**30)


# ---------------------------------------------------------------- naive baseline


def test_pad_sequences_matches_packed_rows():
    w = WORKLOADS["tiny"]
    batch = synthetic_batch(w, 256)
    padded = naive.pad_sequences(batch, [1, 2, 3])
    lens = batch.seq_lens()[1:4]
    assert padded.input_ids.shape == (3, max(lens))
    assert padded.attention_mask.sum(1).tolist() == lens
    cu = batch.cu_seqlens.tolist()
    for row, i in enumerate([1, 2, 3]):
        assert torch.equal(padded.input_ids[row, : lens[row]], batch.input_ids[cu[i] : cu[i + 1]])
        assert torch.equal(padded.loss_mask[row, : lens[row]], batch.loss_mask[cu[i] : cu[i + 1]])
    assert not padded.loss_mask[padded.attention_mask == 0].any()
    assert padded.num_real_tokens == sum(lens)


def test_naive_loss_equals_slipstream_loss_fp32():
    out = naive.loss_cross_check("tiny", micro_batch_size=3)
    assert abs(out["slipstream"]) > 1e-3  # a non-trivial loss, so equality means something
    # fp32, two implementations: measured 3.7e-09 on a loss of ~0.26; 1e-7 = 3 fp32 ulps there
    assert out["naive"] == pytest.approx(out["slipstream"], abs=1e-7)


def test_naive_bench_runs_on_cpu():
    r = naive.bench_naive("tiny", micro_batch_size=3, dtype=torch.float32, repeats=1, warmup=0, device="cpu")
    mb = r["micro_batches"]
    assert mb["count"] == 3 and mb["num_seqs"] == [3, 3, 2]
    assert sum(mb["real_tokens"]) == 264 and sum(mb["padded_tokens"]) > 264
    # exact arithmetic: measured 0
    assert mb["padding_fraction"] == pytest.approx(1 - 264 / sum(mb["padded_tokens"]))
    p = r["phases"]["actor_train"]
    assert p["flops"] == _hand_train_flops(r["workload"]["seq_lens"])  # real tokens only, no padding
    assert p["time_s"] > 0 and p["tok_per_s"] > 0


# ---------------------------------------------------------------- CLI


def test_cli_parser():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        "bench train-step --workload W1 --backend fsdp --max-tokens-per-mb 32768 --ac selective --compile "
        "--repeats 3 --naive --memory-curve 16384,32768 --out r.json --scale 2 --master-dtype bfloat16".split()
    )
    assert args.scale == 2 and args.master_dtype == "bfloat16"
    assert (args.workload, args.backend, args.max_tokens_per_mb, args.ac) == ("W1", "fsdp", 32768, "selective")
    assert args.compile and args.naive and args.repeats == 3
    assert args.memory_curve == [16384, 32768] and str(args.out) == "r.json"
    with pytest.raises(SystemExit):
        parser.parse_args("bench train-step --memory-curve 16k".split())


@pytest.mark.parametrize("diff_rc, expected", [(0, "abc123"), (1, "abc123+modified")])
def test_git_commit_says_when_the_sources_differ_from_head(monkeypatch, diff_rc, expected):
    import subprocess

    from slipstream.bench import train_step

    def fake_run(cmd, **kwargs):
        rc, out = (diff_rc, "") if cmd[1] == "diff" else (0, "abc123\n")
        return subprocess.CompletedProcess(cmd, rc, stdout=out, stderr="")

    monkeypatch.setattr(train_step.subprocess, "run", fake_run)
    assert train_step.git_commit() == expected
    monkeypatch.setenv("SLIPSTREAM_GIT_COMMIT", "named")
    assert train_step.env_info()["git_commit"] == "named"
