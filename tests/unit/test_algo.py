"""Tests for slipstream.algo: advantages, PPO loss, KL estimators, aggregation, split invariance."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from slipstream.algo.losses import rollout_mismatch
from slipstream.algo import (
    AGG_MODES,
    LossSpec,
    aggregate,
    broadcast_to_tokens,
    entropy_bonus,
    get_advantage_fn,
    kl_penalty,
    policy_loss,
    ppo_token_loss,
)
from slipstream.batching.records import LossNorm, PackedBatch
from slipstream.engine.base import accumulate_metrics

F64 = torch.float64


# ---------------------------------------------------------------------------- helpers


def make_batch(
    prompt_lens: list[int],
    resp_lens: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> PackedBatch:
    """Tiny packed batch with random advantages and old/ref/behav log-probs."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + r for p, r in zip(prompt_lens, resp_lens)]
    total = sum(lens)
    cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    input_ids = torch.randint(1, 50, (total,), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lens])
    seq_index = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    targets = torch.zeros(total, dtype=torch.long)
    loss_mask = torch.zeros(total, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        s, e = int(cu[i]), int(cu[i + 1])
        targets[s : e - 1] = input_ids[s + 1 : e]
        # position t predicts token t+1: response tokens p..p+r-1 are predicted from p-1..p+r-2
        loss_mask[s + p - 1 : s + p - 1 + r] = True
    seq_adv = torch.randn(len(lens), generator=g, dtype=F64).to(dtype)
    rand = lambda: (-torch.rand(total, generator=g, dtype=F64) * 2).to(dtype)  # noqa: E731
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu,
        max_seqlen=max(lens),
        targets=targets,
        loss_mask=loss_mask,
        seq_index=seq_index,
        advantages=broadcast_to_tokens(seq_adv, seq_index, loss_mask),
        old_logprobs=rand(),
        ref_logprobs=rand(),
        behav_logprobs=rand(),
    )


def slice_batch(batch: PackedBatch, first: int, last: int) -> tuple[PackedBatch, int, int]:
    """Sequences first..last-1 of `batch` as their own PackedBatch, plus their token range."""
    cu = batch.cu_seqlens
    s, e = int(cu[first]), int(cu[last])
    opt = lambda t: None if t is None else t[s:e]  # noqa: E731
    lens = (cu[first + 1 : last + 1] - cu[first:last]).tolist()
    sub = PackedBatch(
        input_ids=batch.input_ids[s:e],
        position_ids=batch.position_ids[s:e],
        cu_seqlens=cu[first : last + 1] - cu[first],
        max_seqlen=max(lens),
        targets=batch.targets[s:e],
        loss_mask=batch.loss_mask[s:e],
        seq_index=batch.seq_index[s:e] - first,
        advantages=batch.advantages[s:e],
        old_logprobs=opt(batch.old_logprobs),
        ref_logprobs=opt(batch.ref_logprobs),
        behav_logprobs=opt(batch.behav_logprobs),
    )
    return sub, s, e


def norm_of(batch: PackedBatch, max_response_len: float = 12.0) -> LossNorm:
    return LossNorm(
        num_loss_tokens=float(batch.loss_mask.sum()),
        num_seqs=float(batch.num_seqs),
        max_response_len=max_response_len,
    )


PROMPTS = [3, 2, 4, 1, 5, 2, 3, 2, 4]
RESPS = [5, 1, 7, 3, 0, 6, 2, 9, 4]  # includes a sequence with no response tokens


# ---------------------------------------------------------------------------- advantages


def test_grpo_std_normalised_matches_loop_with_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.7, 0.0, 3.0], dtype=F64)
    groups = torch.tensor([5, 5, 5, 5, 2, 2, 2, 9, 7, 7])
    eps = 1e-6
    adv = get_advantage_fn("grpo")(rewards, groups, eps=eps)
    expected = torch.zeros_like(rewards)
    for gid in groups.unique():
        idx = (groups == gid).nonzero().flatten()
        r = rewards[idx]
        if len(idx) > 1 and (r.max() != r.min()):
            expected[idx] = (r - r.mean()) / (r.std() + eps)  # torch.std: unbiased
    # measured 0 (two float64 formulas); 1e-12 = fp64 rounding level
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    # hand values: group 5 has unbiased std sqrt(1/3), so A = +-0.5 * sqrt(3)
    # measured 2.2e-16; 1e-12 = fp64 rounding level
    assert adv[0].item() == pytest.approx(0.5 * math.sqrt(3) / (1 + eps * math.sqrt(3)), abs=1e-12)
    # group 7: mean 1.5, unbiased std 1.5*sqrt(2) -> +-1/sqrt(2)
    # measured 3.3e-07: eps (1e-6) in the std's denominator shifts it; 3x margin
    assert adv[9].item() == pytest.approx(1 / math.sqrt(2), abs=1e-6)
    # constant group (0.1 x 3, whose float mean is not exactly 0.1) and a group of one -> exactly 0
    assert torch.equal(adv[4:8], torch.zeros(4, dtype=F64))


def test_grpo_without_std_is_dr_grpo_and_eps_zero_is_safe():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.7], dtype=torch.float32)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    adv = get_advantage_fn("grpo", std_normalize=False)(rewards, groups)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    adv0 = get_advantage_fn("grpo", eps=0.0)(rewards, groups)
    assert torch.isfinite(adv0).all()
    torch.testing.assert_close(adv0[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 * math.sqrt(3))


def test_rloo_and_reinforce_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 5.0], dtype=F64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 3])
    adv = get_advantage_fn("rloo")(rewards, groups)
    # leave-one-out baselines: 1/3 and 2/3 in group 0; 4 and 2 in group 1; a lone sample gets 0
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0, 0.0], dtype=F64)
    # measured 0; 1e-12 = fp64 rounding level
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    adv = get_advantage_fn("reinforce")(rewards, groups)
    # measured 0; 1e-12 = fp64 rounding level
    torch.testing.assert_close(adv, rewards - 13.0 / 7.0, rtol=0, atol=1e-12)
    # std_normalize: rloo divides by the unbiased group std, reinforce by the unbiased batch std
    adv = get_advantage_fn("rloo", std_normalize=True, eps=0.0)(rewards, groups)
    # measured 0; 1e-12 = fp64 rounding level
    torch.testing.assert_close(adv[:4], expected[:4] / math.sqrt(1 / 3), rtol=0, atol=1e-12)
    # measured 0; 1e-12 = fp64 rounding level
    torch.testing.assert_close(adv[4:6], expected[4:6] / math.sqrt(2), rtol=0, atol=1e-12)
    assert adv[6].item() == 0.0
    adv = get_advantage_fn("reinforce", std_normalize=True, eps=0.0)(rewards, groups)
    # measured 0; 1e-12 = fp64 rounding level
    torch.testing.assert_close(adv, (rewards - rewards.mean()) / rewards.std(), rtol=0, atol=1e-12)
    const = torch.full((3,), 0.1, dtype=F64)
    assert torch.equal(get_advantage_fn("reinforce")(const, groups[:3], std_normalize=True), torch.zeros(3, dtype=F64))


def test_advantage_registry_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'.*grpo"):
        get_advantage_fn("gae")
    with pytest.raises(ValueError, match="bad options"):
        get_advantage_fn("rloo", baseline="mean")
    with pytest.raises(ValueError, match="group_ids"):
        get_advantage_fn("grpo")(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="1-D"):
        get_advantage_fn("grpo")(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))


def test_broadcast_to_tokens():
    seq_adv = torch.tensor([1.5, -2.0, 3.0])
    seq_index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    mask = torch.tensor([False, True, False, True, False, False, True, True])
    out = broadcast_to_tokens(seq_adv, seq_index, mask)
    torch.testing.assert_close(out, torch.tensor([0, 1.5, 0, -2.0, 0, 0, 3.0, 3.0]))


# ---------------------------------------------------------------------------- PPO loss

# (ratio, advantage, loss without dual clip, clipped?, loss with dual clip c=3, dual-clipped?)
# with clip_low=0.2, clip_high=0.3: the ratio is clipped to [0.8, 1.3].
PPO_CASES = [
    (1.1, 2.0, -2.2, False, -2.2, False),  # A>0 inside the range
    (1.5, 2.0, -2.6, True, -2.6, False),  # A>0 above 1+clip_high: clipped
    (0.5, 2.0, -1.0, False, -1.0, False),  # A>0 below 1-clip_low: min keeps r*A, not clipped
    (0.5, -1.0, 0.8, True, 0.8, False),  # A<0 below 1-clip_low: clipped
    (1.2, -1.0, 1.2, False, 1.2, False),  # A<0 inside the range
    (2.0, -1.0, 2.0, False, 2.0, False),  # A<0 above the range: unclipped, under the dual cap 3
    (5.0, -1.0, 5.0, False, 3.0, True),  # A<0 huge ratio: dual clip caps at c*|A|
    (5.0, 1.0, -1.3, True, -1.3, False),  # A>0 huge ratio: ordinary clip, dual clip not applied
    (0.7, 0.0, 0.0, False, 0.0, False),  # zero advantage
]


@pytest.mark.parametrize("dual", [False, True])
def test_ppo_clip_and_dual_clip_hand_values_and_gradients(dual):
    ratio = torch.tensor([c[0] for c in PPO_CASES], dtype=F64)
    adv = torch.tensor([c[1] for c in PPO_CASES], dtype=F64)
    old = torch.full_like(ratio, -1.0)
    logp = (old + ratio.log()).requires_grad_(True)
    loss, stats = ppo_token_loss(logp, old, adv, clip_low=0.2, clip_high=0.3, dual_clip_c=3.0 if dual else None)
    exp_loss = torch.tensor([c[4] if dual else c[2] for c in PPO_CASES], dtype=F64)
    # measured 8.9e-16; 1e-12 = fp64 rounding level
    torch.testing.assert_close(loss.detach(), exp_loss, rtol=0, atol=1e-12)
    assert stats["clipped"].tolist() == [c[3] for c in PPO_CASES]
    if dual:
        assert stats["dual_clipped"].tolist() == [c[5] for c in PPO_CASES]
    else:
        assert "dual_clipped" not in stats
    # measured 8.9e-16; 1e-12 = fp64 rounding level
    torch.testing.assert_close(stats["ratio"], ratio, rtol=0, atol=1e-12)
    # d(-r*A)/d logp = -r*A where the unclipped branch is active; clipped tokens get no gradient
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    inactive = torch.tensor([c[3] or (dual and c[5]) for c in PPO_CASES])
    exp_grad = torch.where(inactive, torch.zeros_like(ratio), -adv * ratio)
    # measured 8.9e-16; 1e-12 = fp64 rounding level
    torch.testing.assert_close(grad, exp_grad, rtol=0, atol=1e-12)


def test_ppo_truncated_importance_weight():
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=F64, requires_grad=True)
    behav = old.detach() - torch.tensor([0.5, 1.5, 4.0, 1.0], dtype=F64).log()  # old/behav = 0.5, 1.5, 4, 1
    adv = torch.tensor([1.0, -2.0, 1.0, 3.0], dtype=F64)
    logp = old.detach().clone().requires_grad_(True)  # ratio 1: base loss is -A
    loss, stats = ppo_token_loss(logp, old, adv, behav_logprobs=behav, behav_is_cap=2.0)
    torch.testing.assert_close(stats["is_weight"], torch.tensor([0.5, 1.5, 2.0, 1.0], dtype=F64))
    torch.testing.assert_close(loss.detach(), torch.tensor([-0.5, 3.0, -2.0, -3.0], dtype=F64))
    # old and behav are constants of the update (even if old carries autograd history): grad = -A * w
    grad, grad_old = torch.autograd.grad(loss.sum(), (logp, old), allow_unused=True)
    torch.testing.assert_close(grad, torch.tensor([-0.5, 3.0, -2.0, -3.0], dtype=F64))
    assert grad_old is None
    loss, _ = ppo_token_loss(logp, old, adv, behav_logprobs=behav)  # no cap: untruncated weight 4
    # measured 8.9e-16; approx's default rel 1e-6 only absorbs rounding
    assert loss[2].item() == pytest.approx(-4.0)


def test_ppo_argument_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_token_loss(x, x, x, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_token_loss(x, x, x, clip_low=1.0)
    with pytest.raises(ValueError, match="advantages shape"):
        ppo_token_loss(x, x, torch.zeros(4))


# ---------------------------------------------------------------------------- KL and entropy


def test_kl_estimators_values_and_gradients():
    logp = torch.tensor([math.log(0.5), math.log(0.1), -2.0, -0.3], dtype=F64, requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.3), -2.0, -1.7], dtype=F64, requires_grad=True)
    d = (logp - ref).detach()
    expected = {
        "k1": (d, torch.ones_like(d)),
        "k2": (0.5 * d**2, d),
        "k3": (torch.exp(-d) + d - 1, 1 - torch.exp(-d)),
    }
    for name, (value, grad) in expected.items():
        kl = kl_penalty(logp, ref, name)
        # measured 0; 1e-12 = fp64 rounding level
        torch.testing.assert_close(kl.detach(), value, rtol=0, atol=1e-12)
        g_logp, g_ref = torch.autograd.grad(kl.sum(), (logp, ref), allow_unused=True)
        # measured 0; 1e-12 = fp64 rounding level
        torch.testing.assert_close(g_logp, grad, rtol=0, atol=1e-12)
        assert g_ref is None  # the reference model is a constant
    # hand value: pi=0.5, ref=0.25 -> k3 = 0.5 - log(0.5) - 1
    # measured 1.1e-16; 1e-12 = fp64 rounding level
    assert kl_penalty(logp, ref, "k3")[0].item() == pytest.approx(math.log(2) - 0.5, abs=1e-12)


def test_k3_value_is_clamped_at_extreme_log_ratios():
    # ref - logp = 23.5: the log-ratio clamp alone gives e^20 - 21 = 4.85e8 for this one token
    logp = torch.tensor([-25.0, -3.0, -0.5, -0.1], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5, -5.0], dtype=F64)
    kl = kl_penalty(logp, ref, "k3")
    d = (ref - logp).detach()
    inside = torch.exp(d) - d - 1  # tokens 1-3: below the bound, unchanged
    # float64 on both sides, the same formula: measured 0.0
    torch.testing.assert_close(kl.detach(), torch.cat([torch.tensor([10.0], dtype=F64), inside[1:]]), rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert g[0] == 0.0  # beyond the bound: no gradient, the token cannot dominate the update
    torch.testing.assert_close(g[1:], (1 - torch.exp(d))[1:], rtol=0, atol=1e-12)
    assert kl.max() <= 10.0
    unclamped = kl_penalty(logp, ref, "k3", k3_bound=None)
    assert unclamped[0].item() == pytest.approx(math.exp(20) - 21, rel=1e-12)  # what the bound prevents
    assert kl_penalty(logp, ref, "k3", k3_bound=2.0)[1].item() == 2.0
    with pytest.raises(ValueError, match="kl_clamp"):
        LossSpec(kl_clamp=0.0)


def test_k1_k3_are_unbiased_estimates_of_kl():
    p = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=F64)
    q = torch.tensor([0.25, 0.25, 0.4, 0.1], dtype=F64)
    exact = (p * (p / q).log()).sum()
    for name in ("k1", "k3"):
        est = (p * kl_penalty(p.log(), q.log(), name)).sum()  # expectation under x ~ p
        # measured 2.8e-17; 1e-12 = fp64 rounding level
        torch.testing.assert_close(est, exact, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(p, q, "k4")


def test_entropy_bonus():
    ent = torch.tensor([0.5, 2.0], dtype=F64)
    torch.testing.assert_close(entropy_bonus(ent, 0.01), torch.tensor([-0.005, -0.02], dtype=F64))


# ---------------------------------------------------------------------------- aggregation


def naive_aggregate(x, mask, seq_index, norm, mode) -> float:
    """Loop over sequences in python floats."""
    seqs: dict[int, list[float]] = {}
    for t in range(len(x)):
        seqs.setdefault(int(seq_index[t]), [])
        if mask[t]:
            seqs[int(seq_index[t])].append(float(x[t]))
    total = sum(sum(v) for v in seqs.values())
    if mode == "token-mean":
        return total / norm.num_loss_tokens
    if mode == "seq-mean-token-mean":
        return sum(sum(v) / len(v) for v in seqs.values() if v) / norm.num_seqs
    if mode == "seq-mean-token-sum":
        return total / norm.num_seqs
    assert mode == "seq-mean-token-sum-norm"
    return total / (norm.num_seqs * norm.max_response_len)


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_aggregate_matches_naive_loop(mode):
    batch = make_batch(PROMPTS, RESPS, seed=1, dtype=F64)
    x = torch.randn(batch.num_tokens, dtype=F64, generator=torch.Generator().manual_seed(3))
    x[~batch.loss_mask] = float("inf")  # masked positions must not leak into the sum
    norm = norm_of(batch)
    got = aggregate(x, batch.loss_mask, batch.seq_index, norm, mode)
    # measured 2.8e-17; 1e-12 = fp64 rounding level
    assert got.item() == pytest.approx(naive_aggregate(x, batch.loss_mask, batch.seq_index, norm, mode), abs=1e-12)


def test_aggregate_errors():
    x = torch.zeros(3)
    mask = torch.ones(3, dtype=torch.bool)
    idx = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        aggregate(x, mask, idx, LossNorm(3, 1, 4), "mean")
    with pytest.raises(ValueError, match="num_loss_tokens"):
        aggregate(x, mask, idx, LossNorm(-1, 1, 4))
    # an empty minibatch gives 0, not NaN
    assert aggregate(x, ~mask, idx, LossNorm(0, 0, 0)).item() == 0.0


# ---------------------------------------------------------------------------- policy_loss


def test_policy_loss_on_policy_is_plain_policy_gradient():
    batch = make_batch(PROMPTS, RESPS, seed=2, dtype=F64).with_(old_logprobs=None, ref_logprobs=None)
    norm = norm_of(batch)
    logp = batch.behav_logprobs.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, None, batch, norm, LossSpec())
    adv, mask = batch.advantages, batch.loss_mask
    # measured 0; 1e-12 = fp64 rounding level
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / norm.num_loss_tokens, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    # measured 1.4e-17; 1e-12 = fp64 rounding level
    torch.testing.assert_close(grad, -adv * mask / norm.num_loss_tokens, rtol=0, atol=1e-12)
    assert metrics["actor/clip_frac"].item() == 0.0
    # measured 0 (ratio of equal log-probs); default rel 1e-6
    assert metrics["actor/ppo_ratio_mean"].item() == pytest.approx(1.0)
    assert "actor/kl" not in metrics and "actor/entropy" not in metrics


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_policy_loss_decomposes_into_its_metrics(mode):
    batch = make_batch(PROMPTS, RESPS, seed=4, dtype=F64)
    norm = norm_of(batch)
    logp = (batch.old_logprobs + 0.3 * torch.randn(batch.num_tokens, dtype=F64)).requires_grad_(True)
    entropy = torch.rand(batch.num_tokens, dtype=F64, requires_grad=True)
    cfg = LossSpec(kl_coef=0.1, entropy_coef=0.01, agg_mode=mode, dual_clip_c=3.0, behav_is_cap=2.0)
    loss, m = policy_loss(logp, entropy, batch, norm, cfg)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    kl = aggregate(kl_penalty(logp, batch.ref_logprobs).detach(), batch.loss_mask, batch.seq_index, norm, mode)
    ent = aggregate(entropy.detach(), batch.loss_mask, batch.seq_index, norm, mode)
    # measured 1.1e-16; 1e-12 = fp64 rounding level
    torch.testing.assert_close(loss.detach(), m["actor/pg_loss"] + 0.1 * kl - 0.01 * ent, rtol=0, atol=1e-12)
    assert 0.0 < m["actor/clip_frac"].item() < 1.0
    assert {"actor/dual_clip_frac", "actor/is_weight_mean", "actor/kl", "actor/entropy"} <= set(m)


def test_policy_loss_masked_infinities_stay_out():
    batch = make_batch(PROMPTS, RESPS, seed=5)
    logp = batch.old_logprobs.clone()
    logp[~batch.loss_mask] = -float("inf")
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, None, batch, norm_of(batch), LossSpec(kl_coef=0.1, dual_clip_c=3.0))
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_policy_loss_config_errors():
    batch = make_batch([2], [3])
    logp, norm = batch.old_logprobs, norm_of(batch)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, None, batch.with_(ref_logprobs=None), norm, LossSpec(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, None, batch, norm, LossSpec(entropy_coef=0.1))
    with pytest.raises(ValueError, match="behav_logprobs"):
        policy_loss(logp, None, batch.with_(behav_logprobs=None), norm, LossSpec(behav_is_cap=2.0))
    with pytest.raises(ValueError, match="aggregation mode"):
        LossSpec(agg_mode="sum")
    with pytest.raises(ValueError, match="KL estimator"):
        LossSpec(kl_estimator="k5")
    with pytest.raises(ValueError, match="dual_clip_c"):
        LossSpec(dual_clip_c=0.5)


# ---------------------------------------------------------------------------- split invariance


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_micro_batch_split_invariance(mode):
    """Summing micro-batch losses, metrics and gradients gives the whole minibatch's, for any split."""
    batch = make_batch(PROMPTS, RESPS, seed=6)  # fp32, like training
    norm = norm_of(batch)
    g = torch.Generator().manual_seed(7)
    logp0 = batch.old_logprobs + 0.3 * torch.randn(batch.num_tokens, generator=g)
    ent0 = torch.rand(batch.num_tokens, generator=g)
    cfg = LossSpec(clip_high=0.28, dual_clip_c=3.0, kl_coef=0.05, entropy_coef=0.01, agg_mode=mode, behav_is_cap=2.0)

    def run(num_splits: int):
        logp = logp0.clone().requires_grad_(True)
        ent = ent0.clone().requires_grad_(True)
        total, metrics = torch.zeros(()), {}
        for chunk in np.array_split(np.arange(batch.num_seqs), num_splits):
            sub, s, e = slice_batch(batch, int(chunk[0]), int(chunk[-1]) + 1)
            loss, m = policy_loss(logp[s:e], ent[s:e], sub, norm, cfg)
            loss.backward()  # gradients accumulate into the full-length leaves, as in training
            total = total + loss.detach()
            accumulate_metrics(metrics, m)  # the engines' reduction: sums, maxima for `_max` metrics
        return total, metrics, logp.grad, ent.grad

    ref_loss, ref_m, ref_glogp, ref_gent = run(1)
    assert ref_glogp.abs().sum() > 0 and ref_gent.abs().sum() > 0
    for k in (3, 7):
        loss, m, glogp, gent = run(k)
        # fp32 sums in another order: measured max |diff| 1.2e-07, 8x margin
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
        # measured 0: per-token gradients do not depend on the split, so exact
        torch.testing.assert_close(glogp, ref_glogp, rtol=0, atol=0)
        # measured 0: per-token gradients do not depend on the split, so exact
        torch.testing.assert_close(gent, ref_gent, rtol=0, atol=0)
        assert m.keys() == ref_m.keys()
        for name in m:
            # rollout/ sums are not normalised (values ~20): fp32 accumulation, measured relative error 9e-8
            tol = dict(rtol=1e-6, atol=0) if name.startswith("rollout/") else dict(rtol=0, atol=1e-6)
            torch.testing.assert_close(m[name], ref_m[name], **tol)


def test_rollout_mismatch_against_float64_hand_computation():
    trainer = torch.tensor([-0.5, -1.0, -2.0, -0.1], dtype=torch.float32)
    behav = torch.tensor([-0.4, -1.3, -2.0, -5.0], dtype=torch.float32)
    mask = torch.tensor([True, True, True, False])  # the last token is not counted (not fresh / no loss)
    m = rollout_mismatch(trainer, behav, mask)
    d = [-0.5 + 0.4, -1.0 + 1.3, 0.0]  # log(pi_trainer / pi_behav) of the counted tokens
    assert m["rollout/mismatch_tokens"] == 3
    # float32 differences against float64 sums: measured error 5.4e-8 and 4.8e-8
    assert float(m["rollout/mismatch_abs_sum"]) == pytest.approx(sum(abs(x) for x in d), abs=1e-6)
    assert float(m["rollout/logprob_abs_diff_max"]) == pytest.approx(0.3, abs=1e-6)
    k3 = sum(math.exp(x) - 1 - x for x in d)  # (r - 1) - log r
    # float32 inputs (log-probs rounded to ~6e-8), float64 arithmetic: measured error 4e-9
    assert float(m["rollout/mismatch_k3_sum"]) == pytest.approx(k3, abs=1e-7)


def test_decoupled_ppo_on_stale_data_matches_float64_hand_computation():
    """Current policy != proximal != behaviour (a stale async sample): ratio against the proximal policy,
    clipped; each token weighted by pi_prox / pi_behav, capped; the weight carries no gradient."""
    logp0 = torch.tensor([-0.7, -2.0, -1.1, -0.3], dtype=F64)  # current policy during the update
    prox = torch.tensor([-1.0, -1.5, -1.0, -0.2], dtype=F64)  # recomputed before the update
    behav = torch.tensor([-1.2, -1.3, -2.9, -0.25], dtype=F64)  # the stale rollout policy
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=F64)
    eps_low, eps_high, cap = 0.2, 0.28, 5.0
    logp = logp0.clone().requires_grad_(True)
    loss, stats = ppo_token_loss(logp, prox, adv, clip_low=eps_low, clip_high=eps_high, behav_logprobs=behav,
                                 behav_is_cap=cap)  # fmt: skip
    expected, expected_grad = [], []
    for lp, px, bh, a in zip(logp0.tolist(), prox.tolist(), behav.tolist(), adv.tolist()):
        r = math.exp(lp - px)
        rc = min(max(r, 1 - eps_low), 1 + eps_high)
        w = min(math.exp(px - bh), cap)
        unclipped, clipped = r * a, rc * a
        expected.append(-w * min(unclipped, clipped))
        # the gradient flows only through the unclipped branch when it is the minimum
        expected_grad.append(-w * a * r if unclipped <= clipped else 0.0)
    # token 0: r = e^0.3 = 1.35 > 1.28 with A > 0 (clipped); token 1: r = e^-0.5 = 0.61 < 0.8 with A < 0
    # (clipped); token 2: w = e^1.9 = 6.7 capped at 5; token 3: r = e^-0.1 inside the range
    # float64 hand computation: measured 0.0
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=F64), rtol=0, atol=1e-12)
    assert stats["is_weight"][2].item() == cap
