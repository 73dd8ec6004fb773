"""Pure RL algorithm functions: advantages, PPO loss, KL estimators, entropy bonus, aggregation."""

from slipstream.algo.advantages import (
    ADVANTAGE_FNS,
    broadcast_to_tokens,
    get_advantage_fn,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)
from slipstream.algo.losses import (
    AGG_MODES,
    KL_ESTIMATORS,
    LossSpec,
    aggregate,
    entropy_bonus,
    get_kl_fn,
    kl_penalty,
    policy_loss,
    ppo_token_loss,
)

__all__ = [
    "ADVANTAGE_FNS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LossSpec",
    "aggregate",
    "broadcast_to_tokens",
    "entropy_bonus",
    "get_advantage_fn",
    "get_kl_fn",
    "grpo_advantages",
    "kl_penalty",
    "policy_loss",
    "ppo_token_loss",
    "reinforce_advantages",
    "rloo_advantages",
]
