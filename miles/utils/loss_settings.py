"""Loss and advantage settings of one adapter, with Miles' flag names and defaults.

Torch-free, so the command line, the adapter config and the train actors share one
type. The trainer's flags build the run-wide settings (`MilesConfig.loss`); an adapter's
config may override the keys in `ADAPTER_LOSS_KEYS` (Beyond Miles: Miles keeps them
global), resolved as `settings.with_overrides(**overrides)`:

    base = LossSettings.from_flags(advantage_estimator="gspo", eps_clip=0.2)
    mine = base.with_overrides(eps_clip_high=0.28, entropy_coef=0.01)

The math that uses them is `miles.backends.common.loss`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")


@dataclass(frozen=True)
class LossSettings:
    """One adapter's loss and advantage settings, with Miles' flag names and defaults.

    `eps_clip_high=None` means `eps_clip`. `grpo_std_normalization` is False under
    `--disable-grpo-std-normalization` (Dr. GRPO) and `rewards_normalization` False under
    `--disable-rewards-normalization`. `kl_coef` shapes the reward before the advantage
    (Miles' `--kl-coef`, used by the reinforce++ estimators); `kl_loss_coef` weights the KL
    term of the loss (`--use-kl-loss`). Validation repeats Miles' checks.
    """

    advantage_estimator: str = "grpo"
    grpo_std_normalization: bool = True
    rewards_normalization: bool = True
    normalize_advantages: bool = False
    gamma: float = 1.0
    kl_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    use_unbiased_kl: bool = False
    entropy_coef: float = 0.0
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_rollout_logprobs: bool = False
    custom_tis_function_path: str | None = None

    def __post_init__(self) -> None:
        if self.advantage_estimator == "ppo":
            raise ValueError("--advantage-estimator ppo is not supported: it needs a critic model, "
                             "which multi-LoRA training has not; "
                             f"choose one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"--advantage-estimator {self.advantage_estimator!r} is not supported; "
                f"choose one of {', '.join(ADVANTAGE_ESTIMATORS)}"
            )
        if self.kl_loss_type not in KL_LOSS_TYPES:
            raise ValueError(f"--kl-loss-type {self.kl_loss_type!r} is not one of {', '.join(KL_LOSS_TYPES)}")
        if self.eps_clip < 0 or (self.eps_clip_high is not None and self.eps_clip_high < 0):
            raise ValueError("--eps-clip and --eps-clip-high must be >= 0")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise ValueError("--eps-clip-c is the lower bound of dual-clip PPO and must be > 1.0, "
                             f"got {self.eps_clip_c}")
        if self.kl_coef != 0 and self.kl_loss_coef != 0:
            raise ValueError("only one of --kl-coef (reward shaping) and --kl-loss-coef (loss term) can be set")
        if self.advantage_estimator.startswith("reinforce_plus_plus") and not self.normalize_advantages:
            raise ValueError(
                f"--advantage-estimator {self.advantage_estimator} requires advantage normalization: "
                "add --normalize-advantages"
            )
        if self.use_rollout_logprobs and self.use_tis:
            raise ValueError("--use-rollout-logprobs and --use-tis cannot be set at the same time")
        if self.tis_clip <= 0 or self.tis_clip_low < 0 or self.tis_clip_low > self.tis_clip:
            raise ValueError("TIS needs 0 <= --tis-clip-low <= --tis-clip and --tis-clip > 0")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"--gamma must be in [0, 1], got {self.gamma}")

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_ref_logprobs(self) -> bool:
        """The base model's logprobs are needed: for the KL loss or for KL reward shaping
        (which only the reinforce++ estimators use)."""
        return self.use_kl_loss or (self.kl_coef != 0 and self.advantage_estimator.startswith("reinforce_plus_plus"))

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.use_tis or self.use_rollout_logprobs

    @classmethod
    def from_flags(cls, **flags: Any) -> LossSettings:
        """Settings from flag values named as Miles' flags (`disable_grpo_std_normalization`,
        `disable_rewards_normalization` are the negations of the two normalization fields);
        unset flags keep their defaults. ValueError with Miles' message when invalid."""
        unknown = sorted(set(flags) - set(LOSS_FLAGS))
        if unknown:
            raise ValueError(f"unknown loss setting(s) {unknown}; valid ones are {list(LOSS_FLAGS)}")
        values = dict(flags)
        if "disable_grpo_std_normalization" in values:
            values["grpo_std_normalization"] = not values.pop("disable_grpo_std_normalization")
        if "disable_rewards_normalization" in values:
            values["rewards_normalization"] = not values.pop("disable_rewards_normalization")
        return cls(**values)

    def flags(self) -> dict[str, Any]:
        """The inverse of `from_flags`: every setting under its flag's name."""
        values = dataclasses.asdict(self)
        values["disable_grpo_std_normalization"] = not values.pop("grpo_std_normalization")
        values["disable_rewards_normalization"] = not values.pop("rewards_normalization")
        return values

    def with_overrides(self, **flags: Any) -> LossSettings:
        """These settings with some flags replaced (an adapter's keys over the trainer's flags);
        ValueError when a key is not in `ADAPTER_LOSS_KEYS` or the result is invalid."""
        unknown = sorted(set(flags) - set(ADAPTER_LOSS_KEYS))
        if unknown:
            raise ValueError(f"{unknown} cannot be set per adapter; "
                             f"per-adapter loss keys are {list(ADAPTER_LOSS_KEYS)}")
        return LossSettings.from_flags(**{**self.flags(), **flags})


LOSS_FLAGS: tuple[str, ...] = (
    "advantage_estimator", "disable_grpo_std_normalization", "disable_rewards_normalization",
    "normalize_advantages", "gamma", "kl_coef", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "use_unbiased_kl",
    "entropy_coef", "eps_clip", "eps_clip_high", "eps_clip_c", "use_tis", "tis_clip", "tis_clip_low",
    "use_rollout_logprobs", "custom_tis_function_path",
)
"""The loss flags, named as Miles' flags (`--advantage-estimator` -> `advantage_estimator`)."""

ADAPTER_LOSS_KEYS: tuple[str, ...] = LOSS_FLAGS
"""Loss flags an adapter config may override. All of them: every setting is gathered per
sample, so adapters with different settings share a batch (`LossParams.gather`)."""
