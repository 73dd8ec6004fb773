"""Reward functions, the reward registry, and the sandboxed multi-process reward runner."""

from slipstream.rewards.functions import countdown_reward, exact_reward, format_reward, math_reward
from slipstream.rewards.registry import REWARDS, CombinedReward, register_reward, resolve_reward
from slipstream.rewards.runner import RewardError, RewardRunner

__all__ = [
    "REWARDS",
    "CombinedReward",
    "RewardError",
    "RewardRunner",
    "countdown_reward",
    "exact_reward",
    "format_reward",
    "math_reward",
    "register_reward",
    "resolve_reward",
]
