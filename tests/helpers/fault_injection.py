"""Train calls that fail on purpose: the torch train rank of the fault tests.

`FaultInjectingTrainActor` is a `TorchTrainActor` whose core raises `InjectedTrainFault` in
the train calls that `MILES_TEST_FAULT_TRAIN_CALLS` names, after the call's first
micro-batch's backward (so partial gradients exist when it fails): "2,5" fails the 2nd and
5th train call of every rank, "1:2" the 2nd of rank 1 only. The product holds no fault
switch: a trainer runs this rank because it is told to, from the repository root (where
`tests` imports), as any rank subclass:

    MILES_TEST_FAULT_TRAIN_CALLS=2 python -m miles.main.train_multi_lora_async ... \\
        --train-actor-path tests.helpers.fault_injection.FaultInjectingTrainActor

A subclass with `faults` set fails those calls whatever the environment says (the rank
actors of a Ray cluster started earlier do not see a variable set later):
`FaultInjectingTrainActor.failing({(-1, 2)})`, or `RANK_1_FAILS_FIRST` by dotted path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from miles.backends.common.batching import ActivationBudget, MicroBatch
from miles.backends.rank.adapters import SlotAdapters
from miles.backends.rank.core import TrainCore
from miles.backends.rank.model import TrainModel
from miles.backends.rank.take_back import TakeBack
from miles.backends.rank.train import BatchTrainer, LossSums, RankTrainResult
from miles.backends.torch.actor import TorchTrainActor
from miles.utils.types import Sample
from miles.utils.types.client import ClientWork

FAULT_TRAIN_CALLS_ENV = "MILES_TEST_FAULT_TRAIN_CALLS"
ACTOR_PATH = "tests.helpers.fault_injection.FaultInjectingTrainActor"
"""`--train-actor-path` of the rank that fails the calls `MILES_TEST_FAULT_TRAIN_CALLS` names."""
RANK_1_FAILS_FIRST = "tests.helpers.fault_injection.Rank1FailsItsFirstTrainCall"


class InjectedTrainFault(RuntimeError):
    """Raised by a train call that the fault list names."""


def fault_train_calls(text: str) -> frozenset[tuple[int, int]]:
    """(rank, call) pairs of `MILES_TEST_FAULT_TRAIN_CALLS` text; rank -1: every rank.

    >>> sorted(fault_train_calls("2, 1:5"))
    [(-1, 2), (1, 5)]
    """
    out = set()
    for part in text.split(","):
        rank, _, call = part.strip().rpartition(":")
        if call:
            out.add((int(rank) if rank else -1, int(call)))
    return frozenset(out)


class FaultInjectingTrainer(BatchTrainer):
    """A `BatchTrainer` whose listed train calls (1-based, per rank) raise after their first micro-batch's backward."""

    def __init__(self, adapters: SlotAdapters, take_back: TakeBack, activation_budget: ActivationBudget | None,
                 faults: frozenset[tuple[int, int]]) -> None:
        super().__init__(adapters, take_back, activation_budget)
        self.rank = adapters.rank
        self.faults = faults
        self.calls = 0
        self._fail_after_backward = False

    def train_batch(self, samples: Sequence[Sample], advantages: Sequence[Any], samples_per_adapter: dict[str, int],
                    client: Sequence[ClientWork] = ()) -> RankTrainResult:
        self.calls += 1
        self._fail_after_backward = bool({(self.rank, self.calls), (-1, self.calls)} & self.faults)
        return super().train_batch(samples, advantages, samples_per_adapter, client)

    def train_micro_batch(self, batch: MicroBatch, stats: dict[str, LossSums]) -> None:
        super().train_micro_batch(batch, stats)
        self._maybe_fail()

    def train_mixed_micro_batch(self, batch: MicroBatch, stats: dict[str, LossSums], outputs: Any) -> None:
        super().train_mixed_micro_batch(batch, stats, outputs)
        self._maybe_fail()

    def _maybe_fail(self) -> None:
        if self._fail_after_backward:
            self._fail_after_backward = False
            raise InjectedTrainFault(f"injected fault in train call {self.calls} of rank {self.rank}")


class FaultInjectingTrainActor(TorchTrainActor):
    """A torch train rank whose core fails the train calls of `faults` (None: of `MILES_TEST_FAULT_TRAIN_CALLS`)."""

    faults: frozenset[tuple[int, int]] | None = None

    @classmethod
    def failing(cls, faults: Iterable[tuple[int, int]]) -> type[FaultInjectingTrainActor]:
        """The rank class that fails exactly these (rank, call) pairs."""
        return type(cls.__name__, (cls,), {"faults": frozenset(faults)})

    def build_core(self, model: TrainModel, activation_budget: ActivationBudget | None = None) -> TrainCore:
        faults = self.faults
        if faults is None:
            faults = fault_train_calls(os.environ.get(FAULT_TRAIN_CALLS_ENV, ""))
        return FaultInjectingCore(self.config, model, self.rank, activation_budget, faults=faults)


class FaultInjectingCore(TrainCore):
    """A `TrainCore` whose train calls are a `FaultInjectingTrainer`'s."""

    def __init__(self, *args: Any, faults: frozenset[tuple[int, int]], **kwargs: Any) -> None:
        self.faults = faults
        super().__init__(*args, **kwargs)

    def build_trainer(self, activation_budget: ActivationBudget | None) -> BatchTrainer:
        return FaultInjectingTrainer(self.slots, self.take_back, activation_budget, self.faults)


class Rank1FailsItsFirstTrainCall(FaultInjectingTrainActor):
    """Rank 1's first train call fails (`RANK_1_FAILS_FIRST`: a DP group's other ranks must take the batch back)."""

    faults = frozenset({(1, 1)})
