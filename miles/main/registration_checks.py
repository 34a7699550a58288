"""The checks the controller runs on a registration, handed to it by whoever starts it.

The controller imports no rollout code: the trainer's launcher and the standalone control
plane (`python -m miles.main.control_plane`) both build these hooks from the rollout side, so a
registration is checked the same way by either (`controller_hooks(cfg)`).
"""

from __future__ import annotations

from miles.controller.backend import ControllerHooks
from miles.utils.arguments import MilesConfig


def controller_hooks(cfg: MilesConfig) -> ControllerHooks:
    """The checks the controller runs at registration (it imports no rollout code): the
    dataset's rows that fit `--rollout-max-prompt-len` (so `num_step` is derived after the
    filter, as in Miles), the reward, and the generate function and filter as the rollout
    calls them. The standalone control plane (`python -m miles.main.control_plane`) runs the same."""
    from miles.rollout.data_source import DatasetCheck
    from miles.rollout.generate import validate_rollout_plugins
    from miles.rollout.rewards import validate_reward_spec

    return ControllerHooks(validate_dataset=DatasetCheck.from_config(cfg), validate_reward=validate_reward_spec,
                           validate_plugins=validate_rollout_plugins)
