"""Per-adapter learning-rate schedule whose clock counts the adapter's trained samples.

Progress is measured in optimizer steps of that adapter:
`progress = samples trained before the current step's batch / adapter_global_batch_size`,
so adapters that train at different speeds (or join late) each follow their own
schedule. Styles: constant, linear, cosine, each with `warmup_steps` of linear warmup
from `warmup_init` (step k < warmup gets `warmup_init + (lr - warmup_init) * k / warmup`:
with warmup 2, steps 0, 1, 2 get warmup_init, the midpoint and `lr`, as Megatron's
`OptimizerParamScheduler` gives Miles) and a decay to `min_lr` over the remaining
`total_steps - warmup_steps` steps. Without a known total (the adapter's `num_step` is
not resolved yet) a decaying style holds `lr` after the warmup.

    schedule = LRSchedule(lr=1e-4, style="cosine", warmup_steps=2, samples_per_step=32,
                          total_steps=100)
    schedule.add_samples(32)
    lr = schedule.begin_step()   # the lr of this optimizer step; advances the clock
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

DecayStyle = Literal["constant", "linear", "cosine"]
DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class LRSchedule:
    lr: float
    samples_per_step: int
    """The adapter's global batch size (rollout_batch_size * n_samples_per_prompt)."""
    style: DecayStyle = "constant"
    warmup_steps: int = 0
    warmup_init: float = 0.0
    """The lr of the first warmup step (`--lr-warmup-init`)."""
    min_lr: float = 0.0
    total_steps: int | None = None
    samples_seen: int = 0
    """Samples trained so far, including those of a batch still accumulating."""
    samples_at_last_step: int = 0
    """Samples trained when the previous optimizer step began its update."""

    def __post_init__(self) -> None:
        if self.style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {DECAY_STYLES}, got {self.style!r}")
        if self.samples_per_step <= 0:
            raise ValueError(f"the adapter's global batch size must be > 0, got {self.samples_per_step}")
        if self.warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError(f"lr and min_lr must be >= 0, got {self.lr} and {self.min_lr}")
        if self.warmup_steps > 0 and not 0 <= self.warmup_init <= self.lr:
            raise ValueError(f"lr_warmup_init must be in 0..lr ({self.lr}), got {self.warmup_init}")

    def add_samples(self, n: int) -> None:
        self.samples_seen += n

    @property
    def progress(self) -> float:
        """Optimizer steps of this adapter completed before the current batch."""
        return self.samples_at_last_step / self.samples_per_step

    def current_lr(self) -> float:
        return self.lr_at(self.progress)

    def begin_step(self) -> float:
        """The lr of the optimizer step being taken now; the clock moves past its batch."""
        lr = self.current_lr()
        self.samples_at_last_step = self.samples_seen
        return lr

    def lr_at(self, progress: float) -> float:
        if self.warmup_steps > 0 and progress < self.warmup_steps:
            return self.warmup_init + (self.lr - self.warmup_init) * progress / self.warmup_steps
        if self.style == "constant" or self.total_steps is None:
            return self.lr
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        fraction = min(1.0, max(0.0, (progress - self.warmup_steps) / decay_steps))
        if self.style == "linear":
            factor = 1.0 - fraction
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * fraction))
        return self.min_lr + (self.lr - self.min_lr) * factor

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LRSchedule:
        return cls(**state)
