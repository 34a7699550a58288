"""The rank actors of a training backend: one Ray actor per rank, in one process group.

`RankLayout` says how the ranks divide into data-parallel replicas (of `tp_size`
tensor-parallel ranks each), hence which samples and client datums each rank trains.
`RankGroup` places the ranks (one bundle each), starts them, joins them in one
torch.distributed group at rank 0's node address, calls every rank or rank 0, and sums
the ranks' shares of a gradient. Either backend's `TrainGroup` holds one:

    ranks = RankGroup(TorchTrainActor, actor_config, RankLayout(replicas=2), num_cpus=1.0, num_gpus=0.0)
    await ranks.start()
    first = (await ranks.each("load_adapter", spec, None, None))[0]
    await ranks.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from miles.backends.base import LoraExport, SaveRequest
from miles.backends.common.checkpoint import AccumulatedGrad
from miles.backends.rank.actor import ExportDescription, TrainRank
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.export import GradShare, sum_grad_shares
from miles.utils import placement

logger = logging.getLogger(__name__)


def split_prompt_groups(group_sizes: Sequence[int], n_ranks: int) -> list[list[int]]:
    """Sample indices of each rank: prompt group i goes to rank i % n_ranks, whole.

    Any split gives the same update (samples enter with weight 1 and gradients are
    summed over ranks); whole groups keep a rank's samples ordered like the batch.
    """
    parts: list[list[int]] = [[] for _ in range(n_ranks)]
    start = 0
    for i, size in enumerate(group_sizes):
        parts[i % n_ranks].extend(range(start, start + size))
        start += size
    return parts


@dataclass(frozen=True)
class RankLayout:
    """Data-parallel replicas of `tp_size` ranks each; global rank r is TP rank `r % tp_size`
    of replica `r // tp_size` (megatron-core's default order)."""

    replicas: int = 1
    tp_size: int = 1
    sharded: bool = False
    """The ranks of a replica hold shards of the slot tensors (Megatron): exports and saves
    gather over them, so every rank takes part; else each rank holds whole tensors, rank 0
    exports and the first live rank saves."""
    label: str = "train"
    """What the log calls a rank ("torch train", "Megatron")."""

    @property
    def world_size(self) -> int:
        return self.replicas * self.tp_size

    def replica_of_rank(self) -> list[int]:
        """The data-parallel replica of each rank; the ranks of a replica train the same samples
        and client datums."""
        return [rank // self.tp_size for rank in range(self.world_size)]

    def rank_parts(self, group_sizes: Sequence[int]) -> list[list[int]]:
        """Sample indices of each rank: prompt groups split whole over the replicas, every rank
        of a replica given the replica's share (its TP ranks score the same samples)."""
        replica_parts = split_prompt_groups(group_sizes, self.replicas)
        return [replica_parts[replica] for replica in self.replica_of_rank()]

    def describe(self) -> str:
        ranks = f"{self.world_size} {self.label} rank(s)"
        return f"{ranks}: {self.replicas} data-parallel x {self.tp_size} tensor-parallel" if self.sharded else ranks


class RankGroup:
    """`layout.world_size` actors of `rank_class`, each built as `rank_class(config, rank, world_size)`."""

    def __init__(self, rank_class: type[TrainRank], config: TrainActorConfig, layout: RankLayout, *,
                 num_cpus: float, num_gpus: float, master_host: str | None = None) -> None:
        self.rank_class = rank_class
        self.config = config
        self.layout = layout
        self.num_cpus, self.num_gpus, self.master_host = num_cpus, num_gpus, master_host
        self._actors: list[Any] = []
        self.placement: Any = None
        """The rank actors' placement group (one bundle per rank); None until started."""
        self.vocab_size: int | None = None
        """The model's vocabulary, read from rank 0 at start."""

    @property
    def actors(self) -> list[Any]:
        """The rank actors' handles, by global rank (empty until started and after shutdown)."""
        return list(self._actors)

    @property
    def first(self) -> Any:
        """Rank 0: it exports, sends pushes and (with whole tensors) writes checkpoints."""
        return self._actors[0]

    async def start(self) -> list[int]:
        """Create the rank actors, one placement bundle each, and join them in one process
        group whose rendezvous is at rank 0's node address; returns each rank's torch threads."""
        import ray

        if self._actors:
            raise RuntimeError(f"{type(self).__name__}.start() was already called")
        n, cpus, gpus = self.layout.world_size, self.num_cpus, self.num_gpus
        # One bundle per rank; ranks that do not fit on one node spread over nodes.
        self.placement = await placement.one_bundle_each(n, cpus=cpus, gpus=gpus)
        remote: Callable[..., Any] = ray.remote  # its stubs lack the `concurrency_groups` it takes
        remote_cls = remote(concurrency_groups=self.rank_class.ray_concurrency_groups)(self.rank_class)
        self._actors = [remote_cls.options(num_cpus=cpus, num_gpus=gpus,
                                           scheduling_strategy=placement.bundle_strategy(self.placement, rank))
                        .remote(self.config, rank, n) for rank in range(n)]
        threads: list[int] = await self.each("ready")
        address = await self.first.master_address.remote(self.master_host)
        await self.each("init_process_group", address)  # a one-rank torch group returns at once
        self.vocab_size = await self.first.vocab_size.remote()
        return threads

    async def each(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every rank at once; the results by rank."""
        return await asyncio.gather(*(getattr(actor, method).remote(*args) for actor in self._actors))

    async def export_from_first(self, name: str, *joining: Any) -> LoraExport:
        """Rank 0's export (`joining`: the calls of the other ranks that take part, awaited too).
        One call: the tensors stay in the object store, their description comes back."""
        tensors_ref, description_ref = self.first.export_for_push.options(num_returns=2).remote(name)
        await asyncio.gather(*joining)
        description: ExportDescription = await description_ref
        return description.export(tensors_ref)

    async def pending_grad(self, name: str) -> dict[str, Tensor]:
        """The adapter's gradient not yet stepped, summed over every rank's share."""
        shares: list[GradShare] = await self.each("accumulated_grad", name)
        return sum_grad_shares(shares)

    async def accumulated_grad(self, request: SaveRequest) -> AccumulatedGrad | None:
        """The gradient of the adapter's `request.accumulated_groups` groups, summed over the
        ranks' shares (`whole_accumulated_grad`)."""
        if request.accumulated_groups == 0:
            return None
        shares: list[GradShare | BaseException] = await asyncio.gather(
            *(actor.accumulated_grad.remote(request.name) for actor in self._actors), return_exceptions=True)
        return whole_accumulated_grad(request, shares)

    async def shutdown(self) -> None:
        """Shut every rank down, kill the actors and release their placement group."""
        import ray

        if not self._actors:
            return
        results = await asyncio.gather(*(actor.shutdown.remote() for actor in self._actors), return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.warning("Train rank %d did not shut down cleanly: %s", rank, result)
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        placement.remove(self.placement)
        self.placement = None


def whole_accumulated_grad(request: SaveRequest,
                           shares: Sequence[GradShare | BaseException]) -> AccumulatedGrad | None:
    """The ranks' shares summed; None when the gradient cannot be whole (a rank is gone, or the
    ranks hold another number of samples than the registry counts, e.g. a batch trained but
    not committed): then the save keeps nothing of the window."""
    failed = [rank for rank, share in enumerate(shares) if isinstance(share, BaseException)]
    if failed:
        logger.warning("Adapter '%s': train rank(s) %s are gone, so the gradient of its %d accumulated group(s) "
                       "is lost; the resumed adapter starts its step's window again", request.name, failed,
                       request.accumulated_groups)
        return None
    whole = [share for share in shares if isinstance(share, GradShare)]
    samples = whole[0].samples  # the same on every rank
    if samples != request.accumulated_samples:
        logger.warning("Adapter '%s': the trainer holds the gradient of %d samples but the registry counts %d "
                       "group(s) (%d samples) toward the next step; the gradient is not saved", request.name,
                       samples, request.accumulated_groups, request.accumulated_samples)
        return None
    return AccumulatedGrad(sum_grad_shares(whole), groups=request.accumulated_groups, samples=samples)
