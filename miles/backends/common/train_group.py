"""The training backend the driver talks to: a `RankGroup` of either backend's ranks, driven as one.

`TrainGroup` implements `miles.backends.base.TrainingBackend` once for both backends. It
lives in the driver process and holds a `RankGroup` (one Ray actor per rank, gloo on CPU
or nccl on GPU); a backend gives it its rank class and `RankLayout`
(`miles.backends.torch.train_group.torch_train_group`,
`miles.backends.megatron.train_group.megatron_train_group`):

    group = torch_train_group(TrainGroupConfig.from_config(cfg))
    await group.start()
    await group.load_adapter(spec)                  # every rank; resumes from a checkpoint
    result = await group.train(rollout_id, batch)   # groups split whole over the replicas
    await group.step_adapters(batch.step_names)
    result = await group.train(rollout_id, batch, client=works)   # client datums dealt over the replicas
    await group.step_adapters(["sft-1"], adam={"sft-1": AdamStep(learning_rate=1e-4)})
    export = await group.export_adapter(name)       # rank 0's tensors, for a weight push
    await group.join_update_group(spec)             # rank 0 joins the engines' update group ...
    await group.broadcast_adapter(export)           # ... and broadcasts the export over it
    await group.save_adapter(SaveRequest(name, step)); await group.shutdown()

It never calls the controller: which adapters to load, push and save, and under which
step, is decided by the loop's stages (`miles.main.stages`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from miles.backends.base import (
    AdapterSpec,
    AdapterStepStats,
    AdapterTrainStats,
    LoadResult,
    LoraExport,
    SaveRequest,
    TrainRankLostError,
    TrainResult,
)
from miles.backends.common import checkpoint
from miles.backends.common.client_loss import client_rows
from miles.backends.common.loss import batch_advantages, needs_reward_kl
from miles.backends.common.rank_group import RankGroup, RankLayout
from miles.backends.rank.actor import ExportDescription, TrainRank
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.train import LossSums, RankTrainResult
from miles.lora.weight_sync import UpdateGroupSpec
from miles.utils.adapter_config import resolved_field
from miles.utils.arguments import MilesConfig
from miles.utils.loss_settings import LossSettings
from miles.utils.plugins import load_subclass
from miles.utils.types import RolloutBatch
from miles.utils.types.client import AdamStep, ClientWork, DatumOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainGroupConfig:
    actor: TrainActorConfig
    n_workers: int = 1
    """Data-parallel replicas (`--actor-num-workers`)."""
    num_cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each rank (`--actor-num-cpus-per-worker`); a CPU rank runs that
    many torch threads (`TrainActorConfig.num_threads`)."""
    num_gpus_per_worker: float = 0.0
    master_host: str | None = None
    """Rendezvous host of the process group; default rank 0's node address when the
    cluster has more than one node, else loopback."""
    actor_path: str | None = None
    """Dotted path of the rank class to run (`--train-actor-path`): a subclass of the
    backend's own (`TrainGroup.rank_class`); None: that class."""

    def __post_init__(self) -> None:
        if self.n_workers <= 0:
            raise ValueError(f"--actor-num-workers must be > 0, got {self.n_workers}")

    @property
    def world_size(self) -> int:
        """Rank actors in the process group (one placement bundle each)."""
        return self.n_workers

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> TrainGroupConfig:
        actor = TrainActorConfig.from_config(cfg)
        return cls(
            actor=actor, n_workers=resolved_field(cfg.actor_num_workers, "--actor-num-workers"),
            num_cpus_per_worker=float(cfg.actor_num_cpus_per_worker),
            num_gpus_per_worker=1.0 if actor.device == "cuda" else 0.0, actor_path=cfg.train_actor_path,
        )


class TrainGroup:
    """A `TrainingBackend` over the ranks of `rank_class` (or the subclass `config.actor_path`
    names) laid out as `layout`."""

    def __init__(self, config: TrainGroupConfig, rank_class: type[TrainRank], layout: RankLayout) -> None:
        if layout.world_size != config.world_size:
            raise ValueError(f"a layout of {layout.world_size} ranks for a group of {config.world_size}")
        self.config = config
        self.rank_class = load_subclass(config.actor_path, rank_class, "--train-actor-path")
        """The class each rank runs: the backend's, or the subclass `config.actor_path` names."""
        self.ranks = RankGroup(self.rank_class, config.actor, layout, num_cpus=config.num_cpus_per_worker,
                               num_gpus=config.num_gpus_per_worker, master_host=config.master_host)
        self._specs: dict[str, AdapterSpec] = {}
        """Loaded adapters (what every rank holds)."""

    @property
    def actors(self) -> list[Any]:
        return self.ranks.actors

    @property
    def loaded_adapters(self) -> dict[str, int]:
        """Loaded adapters and their slots."""
        return {name: spec.slot for name, spec in self._specs.items()}

    async def start(self) -> None:
        threads = sorted(set(await self.ranks.start()))
        logger.info("Started %s; torch threads per rank: %s", self.ranks.layout.describe(), "/".join(map(str, threads)))

    def latest_checkpoint(self, save_dir: str | Path) -> Path | None:
        return checkpoint.latest_checkpoint(save_dir)

    # ---- adapters in slots -------------------------------------------------------------

    async def load_adapter(self, spec: AdapterSpec) -> LoadResult:
        """Every rank loads the adapter, from its latest complete checkpoint if any, else from
        the weights of the latest checkpoint Miles wrote there, if any."""
        latest = checkpoint.latest_checkpoint(spec.save_dir) if spec.save_dir else None
        miles = checkpoint.latest_miles_checkpoint(spec.save_dir) if spec.save_dir and latest is None else None
        results = await self.ranks.each("load_adapter", spec, None if latest is None else str(latest),
                                        None if miles is None else str(miles))
        self._specs[spec.name] = spec
        return results[0]

    async def cleanup_adapter(self, name: str) -> None:
        await self.ranks.each("cleanup_adapter", name)
        del self._specs[name]

    async def export_adapter(self, name: str) -> LoraExport:
        """Rank 0 exports once; the tensors stay in the object store for every engine. Sharded
        ranks all take part in the gather of rank 0's whole tensors."""
        if self.ranks.layout.sharded:
            return await self.ranks.export_from_first(
                name, *(actor.export_adapter.remote(name) for actor in self.ranks.actors[1:]))
        return await self.ranks.export_from_first(name)

    async def fresh_export(self, spec: AdapterSpec) -> LoraExport | None:
        """Rank 0 draws the fresh adapter `load_adapter` would put in the slot, on its push
        thread (a train call may be running); None when a checkpoint would resume it."""
        if spec.save_dir and (checkpoint.latest_checkpoint(spec.save_dir)
                              or checkpoint.latest_miles_checkpoint(spec.save_dir)):
            return None
        tensors_ref, description_ref = self.ranks.first.fresh_export_for_push.options(num_returns=2).remote(spec)
        description: ExportDescription = await description_ref
        return description.export(tensors_ref)

    # ---- weights-update group (rank 0 exports, so rank 0 sends) -------------------------

    async def update_group_endpoint(self) -> tuple[str, int]:
        host, port = await self.ranks.first.update_group_endpoint.remote()
        return host, port

    async def join_update_group(self, spec: UpdateGroupSpec) -> None:
        await self.ranks.first.join_update_group.remote(spec)

    async def leave_update_group(self, group_name: str | None = None) -> None:
        await self.ranks.first.leave_update_group.remote(group_name)

    async def broadcast_adapter(self, export: LoraExport, group_names: Sequence[str], *,
                                bucketed: bool = False) -> dict[str, str]:
        """Rank 0 sends the exported tensors over each group: those it kept when it exported
        them, else read back from the object store (an export given as tensors is sent as is)."""
        first = self.ranks.first
        if isinstance(export.tensors, dict):
            return await first.broadcast_tensors.remote(export.tensors, list(group_names), bucketed)
        return await first.broadcast_export.remote(export.export_id, [export.tensors], list(group_names), bucketed)

    # ---- training --------------------------------------------------------------------

    async def train(self, rollout_id: int, batch: RolloutBatch, client: Sequence[ClientWork] = ()) -> TrainResult:
        """Advantages over whole groups, groups split over the replicas, client datums dealt over
        the replicas, forward and backward."""
        samples, client = batch.samples, list(client)
        if not samples and not client:
            return TrainResult()
        missing = sorted(({s.adapter for s in samples} | {w.adapter for w in client}) - set(self._specs))
        if missing:
            raise RuntimeError(f"rollout {rollout_id} has samples or client work of adapters not loaded on the "
                               f"trainer: {missing}; adapters must be loaded before generation")
        client_rows(client, self.ranks.vocab_size)  # a bad datum fails here, its field named, before any rank trains
        layout, actors = self.ranks.layout, self.ranks.actors
        parts = layout.rank_parts(batch.prompt_group_sizes)
        try:
            reward_kl = await self._reward_kl(batch, parts)
        except Exception as exc:
            raise _rank_error(exc, f"scoring rollout {rollout_id}") from exc
        advantages = self._advantages(batch, reward_kl) if samples else []
        counts = batch.samples_per_adapter()
        replicas = layout.replica_of_rank()
        picks = deal_datums(client, layout.replicas)
        per_rank = await asyncio.gather(*(
            actor.train_batch.remote([samples[i] for i in part], [advantages[i] for i in part], counts,
                                     _client_share(client, picks[replica]))
            for actor, part, replica in zip(actors, parts, replicas)
        ), return_exceptions=True)
        results: list[RankTrainResult] = []
        for out in per_rank:
            if isinstance(out, BaseException):
                # A failed rank took its own share back; the others take theirs back too, so
                # the batch counts on no rank and a later batch is not counted twice.
                await asyncio.gather(*(actor.discard_batch.remote() for actor in actors), return_exceptions=True)
                raise _rank_error(out, f"training rollout {rollout_id}")
            results.append(out)
        return TrainResult(samples=len(samples), adapters=_adapter_stats([r.stats for r in results]),
                           client=_client_outputs(client, results, [picks[replica] for replica in replicas]))

    def _settings(self, name: str) -> LossSettings:
        return self._specs[name].loss or self.config.actor.loss

    def _advantages(self, batch: RolloutBatch,
                    reward_kl: list[list[float] | None] | None = None) -> list[float | list[float]]:
        """Each adapter's advantages from its own groups and loss settings alone, over the
        whole batch (so `--normalize-advantages` whitens over every rank's share, as Miles'
        all-reduce does, and the result does not depend on the number of ranks)."""
        settings = {name: self._settings(name) for name in {s.adapter for s in batch.samples}}
        return batch_advantages(batch.samples, batch.prompt_group_sizes, settings, reward_kl)

    async def _reward_kl(self, batch: RolloutBatch, parts: list[list[int]]) -> list[list[float] | None] | None:
        """The per-token KL to the base model of the samples whose reinforce++ reward
        `--kl-coef` shapes (each rank forwards its own share); None when no adapter needs it."""
        samples = batch.samples
        wanted = {name for name in {s.adapter for s in samples} if needs_reward_kl(self._settings(name))}
        if not wanted:
            return None
        shares = [[i for i in part if samples[i].adapter in wanted] for part in parts]
        per_rank = await asyncio.gather(*(
            actor.reward_kl.remote([samples[i] for i in share]) for actor, share in zip(self.ranks.actors, shares)
        ))
        out: list[list[float] | None] = [None] * len(samples)
        for share, values in zip(shares, per_rank):
            for i, kl in zip(share, values):
                out[i] = kl
        return out

    async def step_adapters(self, names: list[str],
                            adam: dict[str, AdamStep] | None = None) -> dict[str, AdapterStepStats]:
        """Every rank steps the same adapters (their gradients are summed over ranks first),
        those in `adam` with their own Adam settings."""
        names = sorted(set(names))
        unknown = sorted(set(adam or {}) - set(names))
        if unknown:
            raise ValueError(f"Adam settings given for {unknown}, which are not among the adapters to step {names}")
        if not names:
            return {}
        stats: dict[str, AdapterStepStats] = (await self.ranks.each("step_adapters", names, adam))[0]
        return stats

    # ---- checkpoints -------------------------------------------------------------------

    async def save_client_state(self, name: str, directory: str, *, pending: bool = False) -> Path:
        """Rank 0 writes it; with `pending`, the gradient not yet stepped, summed over every
        rank's share. Whole tensors: rank 0 alone (every rank holds the same weights and
        moments); sharded: every rank takes part in the gathers."""
        if not self.ranks.layout.sharded:
            grad = await self.ranks.pending_grad(name) if pending else None
            return Path(await self.ranks.first.save_client_state.remote(name, directory, grad))
        import ray

        ref = ray.put(await self.ranks.pending_grad(name)) if pending else None  # one copy for every rank
        return Path((await self.ranks.each("save_client_state", name, directory, ref))[0])

    async def load_client_state(self, name: str, directory: str, *, optimizer: bool = True) -> None:
        """Every rank loads it."""
        await self.ranks.each("load_client_state", name, directory, optimizer)

    async def save_adapter(self, request: SaveRequest) -> Path:
        """A checkpoint with the accumulated gradient summed over every rank's share. Whole
        tensors: the first live rank writes it (every rank holds the same weights, moments and
        clock); sharded: every rank takes part in the gathers and rank 0 writes."""
        import ray

        accumulated = await self.ranks.accumulated_grad(request)
        if self.ranks.layout.sharded:
            ref = None if accumulated is None else ray.put(accumulated)  # one copy for every rank
            paths = await self.ranks.each("save_adapter", request.name, request.step, request.data_position, ref)
            return Path(paths[0])
        for rank, actor in enumerate(self.ranks.actors):
            try:
                path = await actor.save_adapter.remote(request.name, request.step, request.data_position, accumulated)
            except ray.exceptions.RayActorError:
                logger.warning("Train rank %d is gone; saving adapter '%s' from the next rank", rank, request.name)
                continue
            return Path(path)
        raise TrainRankLostError(f"no train rank is alive to save adapter '{request.name}' at step {request.step}; "
                                 "it resumes from its latest checkpoint")

    async def shutdown(self) -> None:
        await self.ranks.shutdown()
        self._specs.clear()


def _rank_error(exc: BaseException, doing: str) -> BaseException:
    """A dead rank becomes `TrainRankLostError`; any other failure is raised as it came."""
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        return TrainRankLostError(f"a train rank died while {doing}: {exc}")
    return exc


def deal_datums(client: Sequence[ClientWork], n_replicas: int) -> list[list[list[int]]]:
    """`picks[replica][work]`: the datum indices of each work that a replica trains. Datums
    are dealt round robin over the replicas across all works (any split gives the same
    update: each datum's loss is its own and gradients are summed over replicas).

    Works of 3 and 1 datums over 2 replicas: `[[[0, 2], []], [[1], [0]]]`.
    """
    picks: list[list[list[int]]] = [[[] for _ in client] for _ in range(n_replicas)]
    k = 0
    for w, work in enumerate(client):
        for d in range(len(work.datums)):
            picks[k % n_replicas][w].append(d)
            k += 1
    return picks


def _client_share(client: Sequence[ClientWork], picks: list[list[int]]) -> list[ClientWork]:
    """Every work with only the datums `picks` names (possibly none)."""
    return [replace(work, datums=[work.datums[d] for d in chosen]) for work, chosen in zip(client, picks)]


def _client_outputs(client: Sequence[ClientWork], results: Sequence[RankTrainResult],
                    picks: Sequence[list[list[int]]]) -> list[list[DatumOutput]]:
    """Each work's datum outputs in order, from the ranks that report (`picks[rank]`: the datums it trained)."""
    out: list[list[DatumOutput | None]] = [[None] * len(work.datums) for work in client]
    for result, rank_picks in zip(results, picks):
        if result.client is None:
            continue
        for w, (chosen, outputs) in enumerate(zip(rank_picks, result.client)):
            for d, output in zip(chosen, outputs):
                out[w][d] = output
    missing = [(w, d) for w, outputs in enumerate(out) for d, output in enumerate(outputs) if output is None]
    if missing:
        raise RuntimeError(f"no train rank reported the outputs of client datums (work, datum) {missing[:5]}")
    return [[o for o in outputs if o is not None] for outputs in out]


def _adapter_stats(per_rank: list[dict[str, LossSums]]) -> dict[str, AdapterTrainStats]:
    totals: dict[str, LossSums] = {}
    for rank_stats in per_rank:
        for name, sums in rank_stats.items():
            totals[name] = totals.get(name, LossSums()) + sums
    out = {}
    for name, t in sorted(totals.items()):
        n = max(t.samples, 1)
        out[name] = AdapterTrainStats(
            samples=t.samples, loss=t.loss_sum / n, clip_fraction=t.clipped_tokens / max(t.tokens, 1.0),
            kl=t.kl_sum / n, tis_weight=t.tis_sum / n,
        )
    return out
