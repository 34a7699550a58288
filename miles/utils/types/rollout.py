"""Rollout data: samples, prompt groups, data positions, batches and their statistics."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar


class SampleStatus(str, enum.Enum):
    """How a sample's generation ended (Miles' `Sample.Status`, same names and values)."""

    PENDING = "pending"
    """Not generated yet; a generate function must not return a sample in this state."""
    COMPLETED = "completed"
    """Stopped on EOS or a stop string."""
    TRUNCATED = "truncated"
    """Hit `max_new_tokens`."""
    ABORTED = "aborted"
    """Aborted by the engine (or its adapter retired mid-conversation); a group holding
    one is dropped whole."""
    FAILED = "failed"
    """A recoverable failure inside a custom generate function (a tool error, say); the
    sample is rewarded and trained on as it stands."""


@dataclass
class Sample:
    """One prompt and one generated response, with everything training needs.

    The fields plug-ins read and write have Miles' names (`prompt`, `response`,
    `label`, `metadata`, `tokens`, `response_length`, `reward`, `status`, `loss_mask`,
    `rollout_log_probs`, `Sample.Status`), so a reward, filter or generate function
    written for Miles runs unchanged. `tokens` is the prompt followed by the response;
    it is stored split as `prompt_ids` + `response_ids`, and setting `tokens` and then
    `response_length` (Miles' order) moves the split:

    >>> s = Sample("a", 0, 0, 0, "1+1=", "2", {}, [5, 6])
    >>> s.tokens = [5, 6, 7, 8, 9]; s.response_length = 3
    >>> s.prompt_ids, s.response_ids, s.response_length
    ([5, 6], [7, 8, 9], 3)
    """

    Status: ClassVar[type[SampleStatus]] = SampleStatus

    adapter: str
    slot: int
    group_index: int
    """Index of the prompt within the adapter's dataset stream (unique per group)."""
    index: int
    """Position of this response within its prompt group."""
    prompt: str
    label: str | None
    metadata: dict[str, Any]
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response: str = ""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Engine logprob of each response token (for TIS); same length as response_ids."""
    reward: float = 0.0
    status: SampleStatus = SampleStatus.COMPLETED
    loss_mask: list[int] | None = None
    """Per response token: 1 trains on it, 0 does not (tool outputs, environment turns).
    None: every response token is trained on."""
    remove_sample: bool = False
    """Set by a rollout sample filter: the sample carries no loss (its loss mask becomes all 0)."""

    @property
    def tokens(self) -> list[int]:
        """Prompt and response tokens (Miles' `tokens`)."""
        return self.prompt_ids + self.response_ids

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        split = max(0, len(value) - len(self.response_ids))
        self.prompt_ids, self.response_ids = list(value[:split]), list(value[split:])

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @response_length.setter
    def response_length(self, value: int) -> None:
        tokens = self.tokens
        if not 0 <= value <= len(tokens):
            raise ValueError(f"response_length {value} does not fit {len(tokens)} tokens: set sample.tokens "
                             "(prompt + response) before sample.response_length")
        self.prompt_ids, self.response_ids = tokens[: len(tokens) - value], tokens[len(tokens) - value :]

    @property
    def rollout_log_probs(self) -> list[float]:
        """Miles' name of `rollout_logprobs`."""
        return self.rollout_logprobs

    @rollout_log_probs.setter
    def rollout_log_probs(self, value: list[float] | None) -> None:
        self.rollout_logprobs = [] if value is None else [float(v) for v in value]

    @property
    def effective_response_length(self) -> int:
        """Response tokens that are trained on."""
        return self.response_length if self.loss_mask is None else sum(self.loss_mask)

    def get_reward_value(self, args: Any) -> float:
        """The scalar reward (Miles' accessor; rewards here are always one float)."""
        return self.reward

    def validate(self) -> None:
        """ValueError unless the per-token lists match the response (what a generate function returns)."""
        if self.status is SampleStatus.ABORTED:
            return  # its group is dropped whole, whatever it holds
        where = f"sample {self.group_index}/{self.index} of adapter '{self.adapter}'"
        if self.loss_mask is not None:
            if len(self.loss_mask) != self.response_length:
                raise ValueError(f"{where}: loss_mask has {len(self.loss_mask)} entries for "
                                 f"{self.response_length} response tokens")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError(f"{where}: loss_mask entries must be 0 or 1")
        if self.rollout_logprobs and len(self.rollout_logprobs) != self.response_length:
            raise ValueError(f"{where}: {len(self.rollout_logprobs)} rollout_log_probs for "
                             f"{self.response_length} response tokens")
        if self.status is SampleStatus.PENDING:
            raise ValueError(f"{where}: status is still PENDING after generation")


@dataclass
class PromptGroup:
    """The `n_samples_per_prompt` responses to one prompt, stamped at submission."""

    adapter: str
    slot: int
    version: int
    """Slot version when the group was submitted (staleness is measured from it)."""
    registration_id: str
    samples: list[Sample]

    @property
    def aborted(self) -> bool:
        return any(s.status is SampleStatus.ABORTED for s in self.samples)


@dataclass(frozen=True)
class DataPosition:
    """Where an adapter's prompt stream continues: row `index` of epoch `epoch`'s order.

    The order of an epoch depends only on (seed, adapter name, epoch), so this pair is
    enough to continue the stream exactly, in this process or after a restart. It names
    the next prompt not yet handed to generation (see `AdapterDataset.position`).
    """

    epoch: int
    """Epoch of the next prompt (0-based)."""
    index: int
    """Position of the next prompt within that epoch's shuffled order (0-based)."""

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.index < 0:
            raise ValueError(f"a data position needs epoch >= 0 and index >= 0, got {self}")

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataPosition:
        """Read `to_dict`'s output back; ValueError naming what is wrong otherwise."""
        if not isinstance(data, dict) or set(data) != {"epoch", "index"}:
            raise ValueError(f"a data position is {{'epoch': int, 'index': int}}, got {data!r}")
        epoch, index = data["epoch"], data["index"]
        if isinstance(epoch, bool) or isinstance(index, bool) or not isinstance(epoch, int) \
                or not isinstance(index, int):
            raise ValueError(f"a data position is {{'epoch': int, 'index': int}}, got {data!r}")
        return cls(epoch=epoch, index=index)


class DropReason(str, enum.Enum):
    """Why collection dropped a buffered group instead of training on it."""

    STALE = "stale"
    """Generated by weights more than `--max-weight-staleness` pushes old."""
    FOREIGN = "foreign"
    """Stamped with a registration id that is not the adapter's current one."""


@dataclass(frozen=True)
class GenerationCounts:
    """The producer's group counters, cumulative since it started, and its current load."""

    submitted: int = 0
    """Groups submitted for generation."""
    produced: int = 0
    """Groups rewarded and put in a buffer."""
    aborted: int = 0
    """Groups dropped whole because a sample was aborted."""
    filtered: int = 0
    """Groups rejected by the dynamic filter."""
    filtered_by_reason: dict[str, int] = field(default_factory=dict)
    """`filtered` split by the reason the filter gave (`"unspecified"` when it gave none)."""
    failed: int = 0
    """Groups that failed (HTTP or reward error)."""
    in_flight: int = 0
    """Groups submitted and not finished (now, not cumulative)."""
    overflow_dropped: int = 0
    """Groups dropped because a buffer was full."""

    def to_metrics(self, prefix: str) -> dict[str, float]:
        return {
            **{f"{prefix}groups_{event}": float(getattr(self, event))
               for event in ("submitted", "produced", "aborted", "filtered", "failed")},
            f"{prefix}in_flight": float(self.in_flight),
            f"{prefix}overflow_dropped": float(self.overflow_dropped),
            **{f"{prefix}dynamic_filter/drop_{reason}": float(n) for reason, n in self.filtered_by_reason.items()},
        }


@dataclass(frozen=True)
class AdapterRolloutStats:
    """One adapter's rollout numbers, as of one `generate` call.

    Keyed by adapter name in `RolloutBatch.per_adapter`; the names inside are fixed, so
    whatever an adapter is called its numbers cannot land on a loop-wide metric. The
    per-sample and per-group values are kept (not only their means) so that the batches
    of one optimizer step `merge` into the step's statistics, which `to_metrics` names
    as Miles does:

    >>> one = AdapterRolloutStats(groups=1, rewards=(1.0, 1.0), response_lengths=(3, 5),
    ...                           uniform_group_rewards=(1.0,), staleness=(0,))
    >>> two = AdapterRolloutStats(groups=1, rewards=(0.0, 1.0), response_lengths=(4, 8),
    ...                           truncated=1, staleness=(2,))
    >>> m = one.merge(two).to_metrics()
    >>> m["raw_reward_mean"], m["response_len_median"], m["truncated_ratio"], m["max_staleness"]
    (0.75, 4.5, 0.25, 2.0)
    >>> m["zero_std_all_one_percentage"], m["zero_std_all_zero_percentage"]
    (0.5, 0.0)
    >>> AdapterRolloutStats(log_prob_means=(-0.5, -1.5)).to_metrics()["log_probs"]
    -1.0
    """

    groups: int = 0
    """Prompt groups of this adapter in the batch."""
    rewards: tuple[float, ...] = ()
    """Reward of each of its samples in the batch."""
    response_lengths: tuple[int, ...] = ()
    """Trained-on response tokens of each of its samples (Miles' effective response
    length: tool outputs masked out of the loss do not count)."""
    truncated: int = 0
    """Samples that stopped at `max_new_tokens` (status TRUNCATED)."""
    uniform_group_rewards: tuple[float, ...] = ()
    """The reward of each group of two or more samples that all got the same reward
    (zero reward std: the group carries no learning signal)."""
    log_prob_means: tuple[float, ...] = ()
    """Per sample with engine logprobs: the mean of its response tokens' logprobs (Miles'
    `log_probs` averages these)."""
    staleness: tuple[int, ...] = ()
    """Per group: weight pushes between the weights that generated it and the ones the
    engines served when it was collected."""
    queue_length: int = 0
    """Groups left in its buffer after the batch was taken."""
    dropped: dict[DropReason, int] = field(default_factory=dict)
    """Groups collection dropped since the previous batch, per reason."""
    generation: GenerationCounts = GenerationCounts()

    @property
    def raw_reward_mean(self) -> float | None:
        """Mean reward of its samples; None when it has none."""
        return _mean(self.rewards)

    @property
    def response_len_mean(self) -> float | None:
        return _mean(self.response_lengths)

    def merge(self, later: AdapterRolloutStats) -> AdapterRolloutStats:
        """These numbers and those of a later batch: samples and groups pooled, drops
        added, buffer length and producer counters as of the later batch."""
        return AdapterRolloutStats(
            groups=self.groups + later.groups,
            rewards=self.rewards + later.rewards,
            response_lengths=self.response_lengths + later.response_lengths,
            truncated=self.truncated + later.truncated,
            uniform_group_rewards=self.uniform_group_rewards + later.uniform_group_rewards,
            log_prob_means=self.log_prob_means + later.log_prob_means,
            staleness=self.staleness + later.staleness,
            queue_length=later.queue_length,
            dropped={why: self.dropped.get(why, 0) + later.dropped.get(why, 0)
                     for why in set(self.dropped) | set(later.dropped)},
            generation=later.generation,
        )

    def to_metrics(self) -> dict[str, float]:
        """Flat metrics WITHOUT the adapter prefix (the metrics logger adds it), with
        Miles' multi-LoRA names: `raw_reward_{mean,median,max,min}`,
        `response_len_{...}`, `zero_std_all_{zero,one}_percentage`, `log_probs`,
        `truncated_ratio`, `{avg,max}_staleness`; counters under `perf/`."""
        metrics = {
            "perf/groups": float(self.groups),
            "perf/queue_length": float(self.queue_length),
            **{f"perf/{why.value}_dropped": float(self.dropped.get(why, 0)) for why in DropReason},
            **self.generation.to_metrics("perf/"),
            **_statistics("raw_reward_", self.rewards),
            **_statistics("response_len_", self.response_lengths),
        }
        if self.rewards:
            metrics["truncated_ratio"] = self.truncated / len(self.rewards)
        if self.log_prob_means:
            metrics["log_probs"] = sum(self.log_prob_means) / len(self.log_prob_means)
        if self.groups:
            # Miles rounds a uniform group's reward to one decimal before naming it.
            zero = sum(1 for r in self.uniform_group_rewards if round(r, 1) == 0.0)
            one = sum(1 for r in self.uniform_group_rewards if round(r, 1) == 1.0)
            metrics["zero_std_all_zero_percentage"] = zero / self.groups
            metrics["zero_std_all_one_percentage"] = one / self.groups
        if self.staleness:
            metrics["avg_staleness"] = sum(self.staleness) / len(self.staleness)
            metrics["max_staleness"] = float(max(self.staleness))
        return metrics


def _mean(values: tuple[float, ...] | tuple[int, ...]) -> float | None:
    return sum(values) / len(values) if values else None


def _statistics(prefix: str, values: tuple[float, ...] | tuple[int, ...]) -> dict[str, float]:
    """Miles' `compute_statistics` (mean, median, max, min) under `prefix`; {} when empty."""
    if not values:
        return {}
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {f"{prefix}mean": sum(values) / len(values), f"{prefix}median": float(median),
            f"{prefix}max": float(ordered[-1]), f"{prefix}min": float(ordered[0])}


@dataclass(frozen=True)
class RolloutStats:
    """Loop-wide rollout numbers of one `generate` call (all adapters together)."""

    batch_wait_time: float = 0.0
    """Seconds `generate` spent collecting the batch."""
    batch_n_adapters: int = 0
    batch_n_groups: int = 0
    batch_n_samples: int = 0
    batch_n_adapters_to_step: int = 0
    """Adapters whose optimizer step this batch completes."""
    queue_length: int = 0
    """Groups buffered over all adapters after the batch was taken."""
    dropped: dict[DropReason, int] = field(default_factory=dict)
    """Groups collection dropped since the previous batch, per reason."""
    generation: GenerationCounts = GenerationCounts()

    def to_metrics(self) -> dict[str, float]:
        """Flat `perf/rollout/...` metrics."""
        return {
            "perf/rollout/batch_wait_time": self.batch_wait_time,
            "perf/rollout/batch_n_adapters": float(self.batch_n_adapters),
            "perf/rollout/batch_n_groups": float(self.batch_n_groups),
            "perf/rollout/batch_n_samples": float(self.batch_n_samples),
            "perf/rollout/batch_n_adapters_to_step": float(self.batch_n_adapters_to_step),
            "perf/rollout/queue_length": float(self.queue_length),
            **{f"perf/rollout/{why.value}_dropped": float(self.dropped.get(why, 0)) for why in DropReason},
            **self.generation.to_metrics("perf/rollout/"),
        }


@dataclass(frozen=True)
class AdapterGauges:
    """What the driver last saw of one adapter's rollouts, for the controller's `/metrics`."""

    registration_id: str
    """The registration these numbers belong to (a re-registration starts without them)."""
    raw_reward_mean: float | None
    """Mean reward of its latest optimizer step's samples; None before its first step (and
    always for a client-driven adapter, which has no reward)."""
    groups_buffered: int | None
    """Groups generated and waiting in its buffer when the latest batch was taken; None for a
    client-driven adapter (nothing generates for it)."""
    client_loss: float | None = None
    """A client-driven adapter's `loss:sum` over the forward_backward calls of its latest
    optimizer step; None for a server-driven one and before the first step."""


@dataclass
class RolloutBatch:
    """One train batch: whole prompt groups of one or more adapters."""

    rollout_id: int
    samples: list[Sample]
    """Ordered by (slot, group_index, index); groups are contiguous."""
    prompt_group_sizes: list[int]
    """Sizes of the consecutive prompt groups in `samples` (sum == len(samples))."""
    groups_per_adapter: dict[str, int]
    step_names: list[str]
    """Adapters whose accumulated groups reach `rollout_batch_size` with this batch."""
    per_adapter: dict[str, AdapterRolloutStats] = field(default_factory=dict)
    """Rollout numbers of every sampleable adapter (also those with no group here)."""
    stats: RolloutStats = field(default_factory=RolloutStats)
    """Loop-wide rollout numbers."""
    group_versions: list[int] = field(default_factory=list)
    """The slot version each prompt group was submitted at (`PromptGroup.version`), in the
    order of `prompt_group_sizes`; empty when not recorded."""

    def samples_per_adapter(self) -> dict[str, int]:
        """Samples of each adapter in the batch."""
        counts: dict[str, int] = {}
        for sample in self.samples:
            counts[sample.adapter] = counts.get(sample.adapter, 0) + 1
        return counts
