"""Token-level policy losses, KL estimators, entropy bonus and loss aggregation (pure functions).

All per-token tensors are (T,) in the packed layout of `PackedBatch`: index t is the position
that predicts `targets[t]`, and only positions with `loss_mask[t]` contribute. Aggregation divides
by the GLOBAL denominators of the minibatch (`LossNorm`), so summing the losses of its micro-batches
gives the minibatch loss, and the gradients add up the same way, however the minibatch is split.
(Data-parallel gradient averaging divides by the world size; the engine undoes that, not this file.)

Nothing here calls `.item()`: metrics come back as detached 0-dim tensors, synced once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from slipstream.algo.registry import lookup, register
from slipstream.batching.records import LossNorm, PackedBatch

# exp() of a log-ratio beyond +-20 (a factor of ~5e8) only happens for broken tokens; clamping
# keeps it finite in fp32 instead of producing inf * 0 = NaN in the loss.
_LOG_RATIO_CLAMP = 20.0
# Bound of one token's k3 value (verl's low_var_kl clamp). exp() of the log-ratio clamp still
# allows e^20 - 21 = 4.85e8 for a token the reference finds far likelier than the policy; with
# the value clamped, one such token adds at most 10 to the KL term, as the others do.
K3_BOUND = 10.0

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AggFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossNorm], torch.Tensor]
KL_ESTIMATORS: dict[str, KLFn] = {}
AGG_MODES: dict[str, AggFn] = {}


def _fp32_or_wider(x: torch.Tensor) -> torch.Tensor:
    # bf16 log-probs from the engine are upcast so exp/ratios are not computed in 8 mantissa bits.
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _masked(x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # where() rather than x * mask: masked positions may hold inf (e.g. an unreachable prompt
    # target's log-prob), and inf * 0 = NaN would poison the whole sum; where() drops them.
    return torch.where(loss_mask, x, torch.zeros_like(x))


def _check_clip(clip_low: float, clip_high: float, dual_clip_c: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")


# ---------------------------------------------------------------------------- PPO policy loss


def ppo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    behav_logprobs: torch.Tensor | None = None,
    behav_is_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-surrogate PPO loss per token (T,) plus detached per-token stats (ratio, clip masks).

    loss = -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A) with r = exp(logprobs - old_logprobs).
    Dual clip (Ye et al. 2020, c > 1): for A < 0 the loss is also capped at -c*A, so a huge ratio
    on a bad token cannot dominate the update. With `behav_logprobs` (decoupled PPO for off-policy
    rollouts) the token loss is weighted by the detached ratio old/behav, truncated at
    `behav_is_cap` when given.
    """
    _check_clip(clip_low, clip_high, dual_clip_c)
    if behav_is_cap is not None and behav_is_cap <= 0:
        raise ValueError(f"behav_is_cap must be > 0, got {behav_is_cap}")
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")

    logprobs, old_logprobs = _fp32_or_wider(logprobs), _fp32_or_wider(old_logprobs)
    adv = _fp32_or_wider(advantages)
    # Gradient flows through `logprobs` only; the old policy is a constant of this update.
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # max of the negated objectives == -min of the objectives; clipped tokens get zero gradient.
    loss = torch.maximum(loss_unclipped, loss_clipped)
    stats = {"ratio": ratio.detach(), "clipped": (loss_clipped > loss_unclipped).detach()}

    if dual_clip_c is not None:
        # Only negative advantages: there -r*A grows without bound as r grows. The cap -c*A does
        # not depend on logprobs, so dual-clipped tokens get zero gradient.
        cap = -dual_clip_c * adv
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        stats["dual_clipped"] = dual.detach()

    if behav_logprobs is not None:
        if behav_logprobs.shape != logprobs.shape:
            raise ValueError(
                f"behav_logprobs shape {tuple(behav_logprobs.shape)} != logprobs shape "
                f"{tuple(logprobs.shape)}"
            )
        # Decoupled PPO: the proximal policy (old) anchors the clip, and the importance weight
        # old/behav corrects for rollouts sampled by a different (stale or lower-precision) policy.
        behav_log_ratio = old_logprobs.detach() - _fp32_or_wider(behav_logprobs)
        is_weight = torch.exp(behav_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
        if behav_is_cap is not None:
            is_weight = is_weight.clamp(max=behav_is_cap)
        loss = loss * is_weight.detach()
        stats["is_weight"] = is_weight.detach()
    return loss, stats


# ---------------------------------------------------------------------------- KL and entropy


@register(KL_ESTIMATORS, "k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi/ref): unbiased for KL(pi || ref) under samples from pi, high variance."""
    return logprobs - ref_logprobs


@register(KL_ESTIMATORS, "k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * log(pi/ref)^2: biased, low variance, always >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register(KL_ESTIMATORS, "k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, bound: float | None = K3_BOUND) -> torch.Tensor:
    """k3 = ref/pi - log(ref/pi) - 1: unbiased, low variance, always >= 0 (GRPO's choice).

    The value is clamped to [-bound, bound] (None: not clamped); clamp() passes no gradient to a
    token beyond the bound, so such a token stops pulling on the policy instead of dominating it.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    kl = torch.exp(log_ratio) - log_ratio - 1.0
    return kl if bound is None else kl.clamp(-bound, bound)


def get_kl_fn(name: str) -> KLFn:
    """KL estimator by name ("k1", "k2", "k3"); unknown names raise ValueError."""
    return lookup(KL_ESTIMATORS, "KL estimator", name)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3", k3_bound: float | None = K3_BOUND
) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate (T,); gradient flows through `logprobs`, not the reference.

    `k3_bound` clamps the k3 value (see `kl_k3`); k1 and k2 take no bound.
    """
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )
    fn = get_kl_fn(estimator)
    options = {"bound": k3_bound} if estimator == "k3" else {}
    return fn(_fp32_or_wider(logprobs), _fp32_or_wider(ref_logprobs).detach(), **options)


def entropy_bonus(entropy: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token loss term -coef * entropy (T,): minimising it raises entropy when coef > 0."""
    return -coef * _fp32_or_wider(entropy)


# ---------------------------------------------------------------------------- aggregation


def _denominator(value: float, what: str) -> float:
    if value < 0:
        raise ValueError(f"LossNorm.{what} must be >= 0, got {value}")
    # An empty minibatch has a zero numerator too; dividing by 1 returns 0 instead of NaN.
    return value if value > 0 else 1.0


@register(AGG_MODES, "token-mean")
def _agg_token_mean(x: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    return x.sum() / _denominator(norm.num_loss_tokens, "num_loss_tokens")


@register(AGG_MODES, "seq-mean-token-mean")
def _agg_seq_mean_token_mean(
    x: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, norm: LossNorm
) -> torch.Tensor:
    # Loss tokens per sequence. A sequence never spans micro-batches, so this local count is its
    # true length. seq_index < T always (every sequence has >= 1 token), so a (T,) buffer fits
    # without reading the number of sequences back from the device.
    counts = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device).index_add_(0, seq_index, mask.to(x.dtype))
    per_token_weight = 1.0 / counts[seq_index].clamp(min=1.0)
    return (x * per_token_weight).sum() / _denominator(norm.num_seqs, "num_seqs")


@register(AGG_MODES, "seq-mean-token-sum")
def _agg_seq_mean_token_sum(
    x: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, norm: LossNorm
) -> torch.Tensor:
    return x.sum() / _denominator(norm.num_seqs, "num_seqs")


@register(AGG_MODES, "seq-mean-token-sum-norm")
def _agg_seq_mean_token_sum_norm(
    x: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, norm: LossNorm
) -> torch.Tensor:
    # Dr.GRPO: a constant denominator (generation budget) removes the length bias of token-mean.
    denom = _denominator(norm.num_seqs, "num_seqs") * _denominator(norm.max_response_len, "max_response_len")
    return x.sum() / denom


def aggregate(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor,
    norm: LossNorm,
    mode: str = "token-mean",
) -> torch.Tensor:
    """Reduce a per-token loss (T,) over `loss_mask` to a scalar with the minibatch's global denominators."""
    if per_token.shape != loss_mask.shape or seq_index.shape != loss_mask.shape:
        raise ValueError(
            f"per_token {tuple(per_token.shape)}, loss_mask {tuple(loss_mask.shape)} and seq_index "
            f"{tuple(seq_index.shape)} must all be (T,)"
        )
    fn = lookup(AGG_MODES, "aggregation mode", mode)
    return fn(_masked(per_token, loss_mask), loss_mask, seq_index, norm)


# ---------------------------------------------------------------------------- full actor loss


@dataclass(frozen=True)
class LossSpec:
    """Settings of the actor loss: PPO clipping, KL penalty, entropy bonus and aggregation."""

    clip_low: float = 0.2
    """Lower clip range: ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.2
    """Upper clip range: ratio is clipped at 1 + clip_high (DAPO's clip-higher uses 0.28)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages (e.g. 3.0); None disables it."""
    kl_coef: float = 0.0
    """Weight of the per-token KL(pi || ref) penalty in the loss; 0 disables it."""
    kl_estimator: str = "k3"
    """KL estimator: "k1", "k2" or "k3"."""
    kl_clamp: float | None = K3_BOUND
    """k3 only: each token's KL value is clamped to [-kl_clamp, kl_clamp] (zero gradient beyond); None: no clamp."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss term -coef * entropy); 0 disables it."""
    agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-mean, seq-mean-token-sum or seq-mean-token-sum-norm."""
    behav_is_cap: float | None = None
    """Cap of the truncated importance weight old/behav (decoupled PPO); None disables it."""

    def __post_init__(self) -> None:
        _check_clip(self.clip_low, self.clip_high, self.dual_clip_c)
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.behav_is_cap is not None and self.behav_is_cap <= 0:
            raise ValueError(f"behav_is_cap must be > 0 (or None), got {self.behav_is_cap}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"kl_clamp must be > 0 (or None), got {self.kl_clamp}")
        get_kl_fn(self.kl_estimator)
        lookup(AGG_MODES, "aggregation mode", self.agg_mode)


def rollout_mismatch(trainer: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the rollout engine's log-probs are from the trainer's on the same tokens and weights.

    Sums over the `mask` tokens (the caller divides by `rollout/mismatch_tokens`): |trainer - behav|,
    and the k3 estimate of KL(behaviour || trainer), (r - 1) - log r with r = pi_trainer / pi_behav,
    which is unbiased for tokens sampled from the behaviour policy. Plus the largest |difference|.
    """
    m = mask.to(torch.float64)
    log_r = _fp32_or_wider(trainer.detach()).double() - _fp32_or_wider(behav).double()
    k3 = torch.expm1(log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)) - log_r
    diff = log_r.abs() * m
    return {
        "rollout/mismatch_abs_sum": diff.sum(),
        "rollout/mismatch_k3_sum": (k3 * m).sum(),
        "rollout/mismatch_tokens": m.sum(),
        "rollout/logprob_abs_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
    }


def policy_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    batch: PackedBatch,
    norm: LossNorm,
    cfg: LossSpec,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Actor loss of one micro-batch (PPO + kl_coef*KL - entropy_coef*entropy) and detached metrics.

    The loss and every metric use the minibatch's global denominators, so their sums over
    micro-batches equal the minibatch values. pg_loss follows `cfg.agg_mode`; kl, entropy,
    clip_frac and ppo_ratio_mean are token means (per-token quantities, comparable across modes).
    """
    mask, seq_index = batch.loss_mask, batch.seq_index
    # On-policy (single update per rollout): the old policy is the current one, ratio == 1,
    # and the gradient is the plain policy gradient.
    old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    behav = None
    if cfg.behav_is_cap is not None:
        if batch.behav_logprobs is None:
            raise ValueError("LossSpec.behav_is_cap is set but the batch has no behav_logprobs")
        behav = batch.behav_logprobs
    pg, stats = ppo_token_loss(
        logprobs, old, batch.advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip_c,
        behav_logprobs=behav, behav_is_cap=cfg.behav_is_cap,
    )  # fmt: skip

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return aggregate(x.to(pg.dtype), mask, seq_index, norm, "token-mean")

    total = pg
    metrics: dict[str, torch.Tensor] = {}
    if batch.ref_logprobs is not None:
        kl = kl_penalty(logprobs, batch.ref_logprobs, cfg.kl_estimator, k3_bound=cfg.kl_clamp)
        if cfg.kl_coef != 0:
            total = total + cfg.kl_coef * kl
        metrics["actor/kl"] = token_mean(kl.detach())
    elif cfg.kl_coef != 0:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs batch.ref_logprobs, which is None")
    if entropy is not None:
        if entropy.shape != logprobs.shape:
            raise ValueError(f"entropy shape {tuple(entropy.shape)} != logprobs shape {tuple(logprobs.shape)}")
        if cfg.entropy_coef != 0:
            total = total + entropy_bonus(entropy, cfg.entropy_coef)
        metrics["actor/entropy"] = token_mean(entropy.detach())
    elif cfg.entropy_coef != 0:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs per-token entropy, got None")

    loss = aggregate(total, mask, seq_index, norm, cfg.agg_mode)
    metrics["actor/pg_loss"] = aggregate(pg.detach(), mask, seq_index, norm, cfg.agg_mode)
    metrics["actor/clip_frac"] = token_mean(stats["clipped"])
    metrics["actor/ppo_ratio_mean"] = token_mean(stats["ratio"])
    if "dual_clipped" in stats:
        metrics["actor/dual_clip_frac"] = token_mean(stats["dual_clipped"])
    if "is_weight" in stats:
        metrics["actor/is_weight_mean"] = token_mean(stats["is_weight"])
    if batch.behav_logprobs is not None:
        # `old` holds the weights before this update: the rollout's, when the tokens are fresh
        fresh = mask if batch.fresh_mask is None else mask & batch.fresh_mask
        metrics.update(rollout_mismatch(old, batch.behav_logprobs, fresh))
    return loss, metrics


class SpecLoss:
    """`policy_loss` bound to a LossSpec, in the engines' LossFn shape (see engine/base.py).

    The RL loop asks for entropy always (it is logged every step and costs one reduction in the
    fused op); benchmarks may switch it off to time the bare update.
    """

    def __init__(self, spec: LossSpec | None = None, needs_entropy: bool = True) -> None:
        self.spec = spec or LossSpec()
        self.needs_entropy = needs_entropy

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch, norm: LossNorm
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return policy_loss(logprobs, entropy, batch, norm, self.spec)
