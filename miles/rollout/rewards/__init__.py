"""Rewards of rollout samples: built-ins by `rm_type`, user functions by dotted path.

A reward is `fn(args, sample) -> float` (sync or async); see `builtin.py` for the
built-ins and `registry.py` for lookup and registration-time checks.
"""

from miles.rollout.rewards.builtin import BUILTIN_REWARDS, RewardFn
from miles.rollout.rewards.registry import (
    RewardSpec,
    compute_reward,
    get_reward_fn,
    load_custom_reward,
    validate_reward_spec,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardSpec",
    "compute_reward",
    "get_reward_fn",
    "load_custom_reward",
    "validate_reward_spec",
]
