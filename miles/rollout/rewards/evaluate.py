"""Scoring samples and prompt groups: `--reward-key`, `--group-rm` and slow built-ins.

A reward function may return a number or, like Miles' `dapo` and many reward servers, a
dict; `--reward-key` names the entry that is the reward (Miles' `get_reward_value`). With
`--group-rm` an adapter's `custom_rm_path` scores a whole prompt group at once,
`fn(args, samples) -> list[float | dict]` (sync or async), as Miles does outside
multi-LoRA; the built-ins still score each sample. Built-ins that run sympy run in a
worker thread, so a slow comparison does not stall the event loop that generates.

    rewards = await score_group(spec, args, group.samples, group_rm=False, reward_key=None)
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from miles.rollout.rewards.builtin import BUILTIN_REWARDS, THREADED_BUILTINS, RewardFn
from miles.rollout.rewards.registry import RewardSpec
from miles.utils.types import Sample


def reward_value(raw: Any, reward_key: str | None) -> float:
    """The float reward in `raw`: `raw[reward_key]` when a key is given, else `raw` itself."""
    if reward_key is not None:
        if not isinstance(raw, Mapping):
            raise ValueError(f"--reward-key {reward_key!r} is set but the reward is {raw!r}, not a dict")
        if reward_key not in raw:
            raise ValueError(f"--reward-key {reward_key!r} is not in the reward dict (keys: {sorted(raw)})")
        raw = raw[reward_key]
    elif isinstance(raw, Mapping):
        raise ValueError(f"the reward is a dict with keys {sorted(raw)}: "
                         "set --reward-key to the one that is the reward")
    if not isinstance(raw, numbers.Real):
        raise ValueError(f"a reward must be a number, got {type(raw).__name__} {raw!r}")
    return float(raw)


async def call_reward(fn: RewardFn, args: Any, *call_args: Any) -> Any:
    """Call a sync or async reward: async ones awaited, cheap built-ins inline, others in a thread."""
    if inspect.iscoroutinefunction(fn):
        value = await fn(args, *call_args)
    elif fn in BUILTIN_REWARDS.values() and fn not in THREADED_BUILTINS:
        value = fn(args, *call_args)
    else:
        value = await asyncio.to_thread(fn, args, *call_args)
    if inspect.isawaitable(value):
        value = await value
    return value


async def score_sample(fn: RewardFn, args: Any, sample: Sample, *, reward_key: str | None = None) -> float:
    return reward_value(await call_reward(fn, args, sample), reward_key)


async def score_group(
    spec: RewardSpec,
    args: Any,
    samples: Sequence[Sample],
    *,
    group_rm: bool = False,
    reward_key: str | None = None,
) -> list[float]:
    """Rewards of one prompt group, in order: one call per sample, or one call for the group
    when `group_rm` and the adapter has a `custom_rm_path`."""
    if group_rm and spec.custom_rm_path is not None:
        fn = spec.resolve(samples[0])
        values = await call_reward(fn, args, list(samples))
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)) or len(values) != len(samples):
            raise ValueError(
                f"group reward {spec.custom_rm_path!r} must return one reward per sample "
                f"({len(samples)}), got {values!r}"
            )
        return [reward_value(v, reward_key) for v in values]
    return list(await asyncio.gather(*(score_sample(spec.resolve(s), args, s, reward_key=reward_key) for s in samples)))
