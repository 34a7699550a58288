"""Train and commit: one batch through the training backend, then the registry's commit.

    trained = await train.train(rollout_id, batch)   # None: dropped (the backend took it back)
    snapshot = await train.commit(rollout_id)       # the registry counts the groups and steps

`TrainStep` owns the failure policy of a train call: a call that fails is dropped (every rank
took its gradients back, nothing stepped, nothing is committed) and the next batch trains as
usual; `max_failures` failures in a row, or a dead rank (`TrainRankLostError`), stop the run,
and every adapter is saved on the way out. Adapters that step become stale for the weight
push. Only `commit` advances steps, in the registry.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from miles.backends.base import AdapterStepStats, TrainingBackend, TrainRankLostError, TrainResult
from miles.main.handles import ControllerHandle
from miles.main.weight_push import WeightPush
from miles.utils.types import ClientWork, MultiLoRASnapshot, RolloutBatch
from miles.utils.types.lifecycle_ops import MarkBatchTrained

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainedBatch:
    """What one train stage did."""

    result: TrainResult
    steps: dict[str, AdapterStepStats] = field(default_factory=dict)
    """Adapters that took an optimizer step with this batch."""
    client_error: str | None = None
    """Why the client work of the call failed (the RL batch then trained alone); None: it did not."""


class TrainStep:
    def __init__(self, backend: TrainingBackend, controller: ControllerHandle, push: WeightPush, *,
                 max_failures: int = 3) -> None:
        self.backend = backend
        self.controller = controller
        self.push = push
        self.max_failures = max_failures
        self.failures = 0
        """Train calls failed in a row."""

    async def train(self, rollout_id: int, batch: RolloutBatch, *, client: Sequence[ClientWork] = (),
                    drop_failed: bool = True) -> TrainedBatch | None:
        """Forward and backward of the batch (and of the client work, in the same call), then
        the optimizer step of its `step_names`.

        None when the backend failed on this batch (see the module docstring); with
        `drop_failed=False` any failure is raised. When only the client work is at fault (the
        call with it failed, the batch alone trains), the batch trains and `client_error` says why."""
        await self.push.exports_taken()
        client_error = None
        try:
            try:
                result = await (self.backend.train(rollout_id, batch, client=list(client)) if client
                                else self.backend.train(rollout_id, batch))
            except TrainRankLostError:
                raise
            except Exception as exc:
                if not client:
                    raise
                # A client's datums must not cost the RL batch: its commands fail, the batch trains alone.
                client_error = describe(exc)
                logger.warning("Rollout %d with %d client call(s) failed (%s); the client calls fail and the batch "
                               "trains alone", rollout_id, len(client), client_error)
                result = await self.backend.train(rollout_id, batch)
        except TrainRankLostError as exc:
            logger.error("%s. Stopping: every adapter is saved from the surviving ranks; start the trainer again "
                         "with the same --save to resume from those checkpoints", exc)
            raise
        except Exception as exc:
            self.failures += 1
            if not drop_failed:
                raise
            if self.failures >= self.max_failures:
                logger.error("Training failed %d times in a row; stopping", self.failures)
                raise
            logger.error("Training rollout %d failed (%s); its batch is dropped and counts for no adapter "
                         "(%d failure(s) in a row, the run stops at %d)", rollout_id, describe(exc),
                         self.failures, self.max_failures)
            return None
        self.failures = 0
        steps = await self.backend.step_adapters(sorted(set(batch.step_names)))
        self.push.mark_stale(steps)
        return TrainedBatch(result, steps, client_error)

    async def train_client(self, rollout_id: int, batch: RolloutBatch,
                           work: list[ClientWork]) -> tuple[TrainResult | None, str | None]:
        """A call of client work alone (`batch` has no samples): its result, or why it failed."""
        trained = await self.train(rollout_id, batch, client=work)
        if trained is None:
            return None, "the train call failed"
        if trained.client_error is not None:
            return None, trained.client_error
        return trained.result, None

    async def commit(self, rollout_id: int) -> MultiLoRASnapshot:
        """The batch trained: the registry adds its groups and steps (and retires adapters
        that reached `num_step`); returns its snapshot after that."""
        return await self.controller.apply.remote(MarkBatchTrained(rollout_id))


def describe(exc: BaseException) -> str:
    """An error as `Type: message`; through Ray, the rank's own error without its traceback."""
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
