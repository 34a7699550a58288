"""What an adapter's trained batches and steps add up to, for its metrics records.

`StepWindow` (a server-driven adapter's batches since its last optimizer step) and
`ClientWindow` (a client-driven adapter's calls since its last `optim_step`) close into
one adapter record per step; `SampleRate` measures trained samples per second;
`AdapterProgress` is everything the trainer follows of one adapter.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from miles.backends.base import AdapterTrainStats
from miles.main.client_commands import ClientCall, ClientModelReport, ClientStepTaken, reduce_metrics
from miles.utils.types import AdapterKind, AdapterRolloutStats, AdapterState, RolloutBatch

RATE_WINDOW = 8
"""Trained batches an adapter's samples/s is measured over."""


@dataclass
class SampleRate:
    """Samples trained per second over an adapter's latest `RATE_WINDOW` trained batches."""

    trained: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    """(time, samples) of its latest trained batches."""
    since: float = 0.0
    """Start of the window `trained` covers."""

    def add(self, now: float, samples: int) -> None:
        if len(self.trained) == self.trained.maxlen:
            self.since = self.trained[0][0]
        self.trained.append((now, samples))

    def per_s(self, now: float) -> float | None:
        if not self.trained or now <= self.since:
            return None
        return sum(n for _, n in self.trained) / (now - self.since)


@dataclass
class StepWindow:
    """What an adapter's batches since its last optimizer step add up to (its next step record)."""

    rollout: AdapterRolloutStats | None = None
    """Rollout numbers of the batches since its last step."""
    train: list[AdapterTrainStats] = field(default_factory=list)
    """Train numbers of the batches since its last step."""
    batches: int = 0
    """Batches since its last step."""
    filter_drops_logged: dict[str, int] = field(default_factory=dict)
    """The producer's cumulative dynamic-filter drops per reason at its last step record."""

    def add(self, stats: AdapterRolloutStats, train: AdapterTrainStats | None) -> None:
        self.rollout = stats if self.rollout is None else self.rollout.merge(stats)
        self.batches += 1 if stats.groups else 0
        if train is not None:
            self.train.append(train)

    def close(self) -> dict[str, float]:
        """The step record's numbers; starts the next step's window."""
        metrics: dict[str, float] = {"perf/step_batches": float(self.batches)}
        if self.rollout is not None:
            metrics.update(self.rollout.to_metrics())
            drops = self.rollout.generation.filtered_by_reason
            for reason, total in drops.items():
                metrics[f"dynamic_filter/drop_{reason}"] = float(total - self.filter_drops_logged.get(reason, 0))
            self.filter_drops_logged = dict(drops)
        metrics.update(merge_train(self.train))
        self.drop()
        return metrics

    def drop(self) -> None:
        """Forget the batches since the last step (the drop counts' baseline stays)."""
        self.rollout, self.train, self.batches = None, [], 0


@dataclass
class ClientWindow:
    """What a client-driven adapter's commands since its last `optim_step` add up to (its
    next step record)."""

    calls: list[ClientCall] = field(default_factory=list)
    """Its forward_backward calls since its last step."""
    seconds: float = 0.0
    """Its time in the trainer since its last step."""

    def add(self, report: ClientModelReport) -> None:
        self.calls.extend(report.calls)
        self.seconds += report.seconds

    def close(self, step: ClientStepTaken) -> dict[str, float]:
        """The step record's numbers; starts the next step's window."""
        adam = step.adam
        metrics = {
            **reduce_metrics(self.calls),
            "forward_backward_calls": float(len(self.calls)),
            "train_datums": float(sum(c.datums for c in self.calls)),
            "train_tokens": float(sum(c.tokens for c in self.calls)),
            "lr": adam.learning_rate if step.stats is None else step.stats.lr,
            "weight_decay": adam.weight_decay, "grad_clip_norm": adam.grad_clip_norm,
            "adam_beta1": adam.beta1, "adam_beta2": adam.beta2, "adam_eps": adam.eps,
            "perf/train_time": self.seconds,
        }
        if step.stats is not None:
            metrics["grad_norm"] = step.stats.grad_norm
        self.drop()
        return metrics

    def drop(self) -> None:
        self.calls, self.seconds = [], 0.0


@dataclass
class AdapterProgress:
    name: str
    registration_id: str
    save_dir: str | None
    final_step: int | None
    """Step at which this registration retires by itself (its start step + num_step)."""
    kind: AdapterKind = AdapterKind.SERVER
    state: AdapterState = AdapterState.PENDING
    step: int = 0
    rewards: list[float] = field(default_factory=list)
    """`raw_reward_mean` of each optimizer step (all its registrations)."""
    losses: list[float] = field(default_factory=list)
    """Each optimizer step's loss: the sample-weighted train `loss` of a server-driven adapter,
    the `loss:sum` of a client-driven one's forward_backward calls."""
    window: StepWindow = field(default_factory=StepWindow)
    client: ClientWindow = field(default_factory=ClientWindow)
    """A client-driven adapter's calls since its last step (`window` stays empty for it)."""
    resume_from: str | None = None
    """A client-driven adapter's latest saved (or loaded) checkpoint directory."""
    rate: SampleRate = field(default_factory=SampleRate)
    """Samples (a client-driven adapter's datums) trained per second."""


def batch_composition(rollout: RolloutBatch) -> dict[str, dict[str, int]]:
    """The loop record's `batch`: each adapter's prompt groups and samples in the batch."""
    samples = rollout.samples_per_adapter()
    return {name: {"groups": groups, "samples": samples.get(name, 0)}
            for name, groups in sorted(rollout.groups_per_adapter.items())}


def merge_train(stats: list[AdapterTrainStats]) -> dict[str, float]:
    """Train numbers of one step's batches: per-sample means weighted by samples, samples added."""
    samples = sum(s.samples for s in stats)
    if samples == 0:
        return {}
    merged: dict[str, float] = {}
    for s in stats:
        for key, value in s.to_metrics().items():
            merged[key] = merged.get(key, 0.0) + value * s.samples / samples
    return {**merged, "train_samples": float(samples)}
