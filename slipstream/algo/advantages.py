"""Sequence-level advantage estimators (pure functions of rewards and group ids).

Every estimator has the signature
`fn(rewards (N,), group_ids (N,), *, std_normalize: bool, eps: float) -> (N,)`, where completions
of the same prompt share a group id, so the training loop can call any of them the same way.
Estimators are registered by name in `ADVANTAGE_FNS`; `get_advantage_fn(name, **options)`
binds options once, at config time.

These run once per RL step on N = (prompts x completions) scalars, so they favour clarity
(float64 internally, `torch.unique` over group ids) over avoiding host syncs.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from slipstream.algo.registry import lookup, register

AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGE_FNS: dict[str, AdvantageFn] = {}


def _check_inputs(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.dtype.is_floating_point else torch.float32


class _GroupStats:
    """Per-group count, mean, unbiased std and constancy, gathered back to each sample (float64)."""

    def __init__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
        r = rewards.to(torch.float64)
        # inverse maps each sample to a dense group index 0..G-1, so ids need not be contiguous.
        _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
        num_groups = counts.numel()
        counts_f = counts.to(torch.float64)
        mean = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, r)
        mean = mean / counts_f
        centred = r - mean[inv]
        sq = torch.zeros_like(mean).index_add_(0, inv, centred * centred)
        # Unbiased (Bessel-corrected) variance, as torch.std's default and TRL's GRPO use.
        # A group of one has no spread: its std is defined as 0 (its centred reward is 0 too).
        var = sq / (counts_f - 1).clamp(min=1)
        hi = torch.full_like(mean, -torch.inf).scatter_reduce(0, inv, r, reduce="amax")
        lo = torch.full_like(mean, torch.inf).scatter_reduce(0, inv, r, reduce="amin")
        self.count = counts_f[inv]
        self.mean = mean[inv]
        self.std = var.sqrt()[inv]
        # Constant groups carry no learning signal; rounding in the mean (e.g. 3 x 0.1) would
        # otherwise leave tiny non-zero residuals that std-normalisation can blow up.
        self.constant = (hi == lo)[inv]
        self.centred = centred

    def zero_constant(self, adv: torch.Tensor) -> torch.Tensor:
        """Set the advantage of constant groups (incl. groups of one) to exactly 0."""
        return torch.where(self.constant, torch.zeros_like(adv), adv)


def _finish(stats: _GroupStats, adv: torch.Tensor, std_normalize: bool, eps: float, dtype) -> torch.Tensor:
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if std_normalize:
        adv = adv / (stats.std + eps)
    # Applied after the division so eps=0 on a constant group gives 0, not 0/0.
    return stats.zero_constant(adv).to(dtype)


@register(ADVANTAGE_FNS, "grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g when std_normalize=False (Dr.GRPO).

    std_g is the unbiased (n-1) sample std of the group, matching torch.std and TRL's GRPO.
    Groups of size 1 and groups with constant reward get advantage exactly 0.
    """
    _check_inputs(rewards, group_ids)
    stats = _GroupStats(rewards, group_ids)
    return _finish(stats, stats.centred, std_normalize, eps, _out_dtype(rewards))


@register(ADVANTAGE_FNS, "rloo")
def rloo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """RLOO: A_i = r_i - mean of the other members of i's group (/ (std_g + eps) if std_normalize).

    Groups of size 1 and constant groups get 0; std_g is the unbiased group std as in "grpo".
    """
    _check_inputs(rewards, group_ids)
    stats = _GroupStats(rewards, group_ids)
    # r_i - (sum_g - r_i)/(n-1) == n/(n-1) * (r_i - mean_g); clamp avoids 1/0 for n == 1.
    scale = stats.count / (stats.count - 1).clamp(min=1)
    return _finish(stats, scale * stats.centred, std_normalize, eps, _out_dtype(rewards))


@register(ADVANTAGE_FNS, "reinforce")
def reinforce_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE with a batch-mean baseline: A_i = r_i - mean(r) (/ (std(r) + eps) if std_normalize).

    Group ids are ignored: the whole batch is one group (unbiased std; a constant batch gives 0).
    """
    _check_inputs(rewards, group_ids)
    stats = _GroupStats(rewards, torch.zeros_like(group_ids))
    return _finish(stats, stats.centred, std_normalize, eps, _out_dtype(rewards))


def get_advantage_fn(name: str, **options) -> AdvantageFn:
    """Look up an estimator by name and bind its keyword options; unknown names/options raise ValueError."""
    fn = lookup(ADVANTAGE_FNS, "advantage estimator", name)
    if not options:
        return fn
    try:
        inspect.signature(fn).bind_partial(None, None, **options)
    except TypeError as err:
        raise ValueError(f"bad options for advantage estimator {name!r}: {err}") from None
    return functools.partial(fn, **options)


def broadcast_to_tokens(
    seq_adv: torch.Tensor, seq_index: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Spread sequence advantages (n,) to packed tokens (T,); 0 where loss_mask is False."""
    if seq_adv.dim() != 1:
        raise ValueError(f"seq_adv must be 1-D (n,), got shape {tuple(seq_adv.shape)}")
    if seq_index.shape != loss_mask.shape:
        raise ValueError(
            f"seq_index shape {tuple(seq_index.shape)} != loss_mask shape {tuple(loss_mask.shape)}"
        )
    per_token = seq_adv[seq_index]
    # Prompt tokens and sequence ends get 0, as PackedBatch.advantages documents.
    return torch.where(loss_mask, per_token, torch.zeros_like(per_token))
