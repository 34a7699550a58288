"""Finding an adapter's reward function: built-ins by `rm_type`, user ones by dotted path.

`validate_reward_spec` runs when an adapter registers, so a typo is a 400 at the control
plane rather than a crash in the producer. `RewardSpec.resolve` picks the function for
one sample: `custom_rm_path` when set, else the adapter's `rm_type`, else the sample's
`metadata["rm_type"]`, else `--rm-type`.

    validate_reward_spec("math", None)              # ok
    validate_reward_spec(None, "my_pkg.rewards.fn")  # ok if importable, fn(args, sample)
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any

from miles.rollout.rewards.builtin import BUILTIN_REWARDS, RewardFn
from miles.utils.plugins import load_callable
from miles.utils.types import Sample


def _valid_types() -> str:
    return ", ".join(sorted(BUILTIN_REWARDS))


def get_reward_fn(rm_type: str) -> RewardFn:
    """The built-in reward named `rm_type`; ValueError listing the valid ones otherwise."""
    try:
        return BUILTIN_REWARDS[rm_type]
    except KeyError:
        raise ValueError(f"unknown rm_type {rm_type!r}; valid built-in types: {_valid_types()}") from None


def load_custom_reward(path: str) -> RewardFn:
    """The user reward at dotted `path`, checked to take `(args, sample)`; ValueError otherwise."""
    return load_callable(path, kind="custom_rm_path", params="args, sample")


def validate_reward_spec(rm_type: str | None, custom_rm_path: str | None) -> None:
    """Check at registration that a reward can be found; ValueError says what to fix."""
    if rm_type is None and custom_rm_path is None:
        raise ValueError(
            f"no reward: set rm_type in the adapter or --rm-type (built-in types: {_valid_types()}), "
            "or custom_rm_path / --custom-rm-path"
        )
    if custom_rm_path is not None:
        load_custom_reward(custom_rm_path)
    if rm_type is not None:
        get_reward_fn(rm_type)


@dataclass(frozen=True)
class RewardSpec:
    """How an adapter's samples are rewarded: its own settings over the process defaults."""

    rm_type: str | None
    custom_rm_path: str | None
    default_rm_type: str | None = None
    """`--rm-type`: the last resort, after the sample's `metadata["rm_type"]`."""

    def resolve(self, sample: Sample) -> RewardFn:
        if self.custom_rm_path is not None:
            return load_custom_reward(self.custom_rm_path)
        rm_type = self.rm_type or sample.metadata.get("rm_type") or self.default_rm_type
        if rm_type is None:
            raise ValueError(f"adapter {sample.adapter!r}: no rm_type in the adapter, the sample metadata or --rm-type")
        return get_reward_fn(rm_type)


async def compute_reward(fn: RewardFn, args: Any, sample: Sample) -> float:
    """Call a sync or async reward; user sync rewards run in a thread to spare the loop."""
    if inspect.iscoroutinefunction(fn):
        value = await fn(args, sample)
    elif fn in BUILTIN_REWARDS.values():
        value = fn(args, sample)
    else:
        value = await asyncio.to_thread(fn, args, sample)
    if inspect.isawaitable(value):
        value = await value
    return float(value)
