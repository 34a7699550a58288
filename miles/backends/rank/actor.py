"""A train rank as the Ray actor `TrainGroup` drives: a `TrainCore` over the backend's
`TrainModel`, the weights-update sender, and this rank's place in the process group.

Each method delegates: training, adapters, exports and checkpoints to the core; the
weights-update group to the sender, on the `WEIGHT_PUSH` thread. A backend's rank class
subclasses `TrainRank` and builds its model (`TorchTrainActor`, `MegatronTrainActor`); it is
a plain class, so a single rank can be driven in-process as well:

    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint="/tmp/tiny", n_slots=4, lora_rank=8))
    actor.load_adapter(AdapterSpec(name="math", slot=0, rank=8, alpha=16.0, global_batch_size=8))
    actor.train(samples, advantages, samples_per_adapter={"math": 8})
    actor.step_adapters(["math"])
    tensors, description = actor.export_for_push("math")
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ray
import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.base import AdapterSpec, AdapterStepStats, LoadResult, LoraExport
from miles.backends.common.batching import ActivationBudget, Advantage
from miles.backends.common.checkpoint import AccumulatedGrad, OptimizerState
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.core import TrainCore
from miles.backends.rank.export import GradShare
from miles.backends.rank.model import TrainModel
from miles.backends.rank.sender import WEIGHT_PUSH, UpdateGroupSender
from miles.backends.rank.train import LossSums, RankTrainResult
from miles.lora.weight_sync import UpdateGroupSpec, listening_store, tensor_metadata
from miles.utils.network import cluster_host
from miles.utils.types import DataPosition, Sample
from miles.utils.types.client import AdamStep, ClientWork


@dataclass(frozen=True)
class ExportDescription:
    """What an engine needs besides the tensors to receive an export."""

    peft_config: dict[str, Any]
    """Contents of `adapter_config.json`."""
    names: list[str]
    """The tensors' names, dtypes and shapes in broadcast order."""
    dtypes: list[str]
    shapes: list[list[int]]
    nbytes: int
    """Bytes of the tensors: what one push sends to each engine."""
    export_id: str = field(default="", compare=False)
    """Names this export on the rank that made it, which keeps its tensors to broadcast them
    (two exports of the same tensors are equal whatever their ids)."""

    @classmethod
    def of(cls, tensors: dict[str, Tensor], peft_config: dict[str, Any]) -> ExportDescription:
        names, dtypes, shapes = tensor_metadata(tensors)
        return cls(peft_config=peft_config, names=names, dtypes=dtypes, shapes=shapes,
                   nbytes=sum(t.numel() * t.element_size() for t in tensors.values()), export_id=uuid.uuid4().hex)

    def export(self, tensors: Any) -> LoraExport:
        """The `LoraExport` of `tensors` (a dict, or the ObjectRef of one) as described here."""
        return LoraExport(peft_config=self.peft_config, tensors=tensors, names=self.names, dtypes=self.dtypes,
                          shapes=self.shapes, nbytes=self.nbytes, export_id=self.export_id)


class RankExport(NamedTuple):
    """An export as a rank returns it: two Ray returns (`num_returns=2`), so the tensors stay
    in the object store for the engines while the train group reads only the description."""

    tensors: dict[str, Tensor]
    description: ExportDescription


class TrainRank:
    """One train rank: its `TrainCore` and `UpdateGroupSender`, and its place in the process group."""

    ray_concurrency_groups = {WEIGHT_PUSH: 1}
    """Ray runs the weights-update group's methods on a thread of their own, so a push can
    run behind the next train call (`--overlap-weight-push`); `TrainGroup` passes this to
    `ray.remote`."""

    def __init__(self, config: TrainActorConfig, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(config.device)
        if self.device.type == "cpu" and config.num_threads:  # the CPUs Ray reserved for this rank
            torch.set_num_threads(config.num_threads)
        self.sender = UpdateGroupSender(self.device)
        self._core: TrainCore | None = None
        self._rendezvous: dict[int, dist.TCPStore] = {}
        """The store rank 0 listens on for the process group, by port, until it is joined."""

    def build_core(self, model: TrainModel, activation_budget: ActivationBudget | None = None) -> TrainCore:
        """The core over this rank's model, once the model is built; a subclass may return a
        `TrainCore` subclass."""
        return TrainCore(self.config, model, self.rank, activation_budget)

    def _compose(self, model: TrainModel, activation_budget: ActivationBudget | None = None) -> None:
        self._core = self.build_core(model, activation_budget)

    @property
    def core(self) -> TrainCore:
        if self._core is None:
            raise RuntimeError(f"train rank {self.rank} has no model yet: call init_process_group first")
        return self._core

    @property
    def model(self) -> TrainModel:
        return self.core.model

    # ---- distributed set-up -------------------------------------------------------

    def ready(self) -> int:
        """The rank's torch threads, once it is built."""
        return torch.get_num_threads()

    def vocab_size(self) -> int:
        """Tokens the model scores (once it is built)."""
        return self.model.vocab_size

    def master_address(self, host: str | None = None) -> str:
        """The process group's rendezvous address (called on rank 0): on `host`, by default this
        node's address when the cluster has more than one node, else loopback. The port is
        held from now until `init_process_group`."""
        host = host or cluster_host()
        store = listening_store(host)
        self._rendezvous = {**self._rendezvous, store.port: store}
        return f"tcp://{host}:{store.port}"

    def init_process_group(self, address: str, timeout_s: float = 600.0) -> None:
        if self.world_size > 1:
            self._join_default_group(address, timeout_s)

    def _join_default_group(self, address: str, timeout_s: float) -> None:
        from torch.distributed.distributed_c10d import PrefixStore

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = self._rendezvous.pop(int(address.rsplit(":", 1)[1]), None) if self.rank == 0 else None
        if store is None:
            dist.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world_size,
                                    timeout=timeout)
        else:  # the store rank 0 listens on, prefixed as the `tcp://` rendezvous prefixes it
            store.set_timeout(timeout)
            dist.init_process_group(backend, store=PrefixStore("default_pg", store), rank=0,
                                    world_size=self.world_size, timeout=timeout)

    def shutdown(self) -> None:
        self.sender.leave()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- weights-update group (the exporting rank: rank 0) ---------------------------

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def update_group_endpoint(self) -> tuple[str, int]:
        return self.sender.endpoint()

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def join_update_group(self, spec: UpdateGroupSpec) -> None:
        self.sender.join(spec)

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def leave_update_group(self, group_name: str | None = None) -> None:
        self.sender.leave(group_name)

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def broadcast_tensors(self, tensors: dict[str, Tensor], group_names: Sequence[str],
                          bucketed: bool = False) -> dict[str, str]:
        return self.sender.broadcast(tensors, group_names, bucketed)

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def broadcast_export(self, export_id: str, tensors_ref: Sequence[ray.ObjectRef], group_names: Sequence[str],
                         bucketed: bool = False) -> dict[str, str]:
        """Broadcast an export of this rank: the tensors it kept when it made it (already laid
        out for the wire after the first push), else read back from `tensors_ref` (a
        one-element list, so Ray hands over the reference and reads nothing unless asked)."""
        return self.sender.broadcast_kept(export_id, lambda: ray.get(tensors_ref[0]), group_names, bucketed)

    # ---- adapters, training, exports and checkpoints: the core's --------------------------

    def load_adapter(self, spec: AdapterSpec, checkpoint: str | None = None,
                     miles_checkpoint: str | None = None) -> LoadResult:
        return self.core.load_adapter(spec, checkpoint, miles_checkpoint)

    def cleanup_adapter(self, name: str) -> None:
        self.core.cleanup_adapter(name)
        self.sender.forget(name)

    def loaded_adapters(self) -> dict[str, int]:
        return self.core.loaded_adapters()

    def train(self, samples: Sequence[Sample], advantages: Sequence[Advantage],
              samples_per_adapter: dict[str, int]) -> dict[str, LossSums]:
        return self.core.train(samples, advantages, samples_per_adapter)

    def train_batch(self, samples: Sequence[Sample], advantages: Sequence[Advantage],
                    samples_per_adapter: dict[str, int], client: Sequence[ClientWork] = ()) -> RankTrainResult:
        return self.core.train_batch(samples, advantages, samples_per_adapter, client)

    def discard_batch(self) -> None:
        self.core.discard_batch()

    def step_adapters(self, names: Sequence[str],
                      adam: dict[str, AdamStep] | None = None) -> dict[str, AdapterStepStats]:
        return self.core.step_adapters(names, adam)

    def reward_kl(self, samples: Sequence[Sample]) -> list[list[float]]:
        return self.core.reward_kl(samples)

    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        return self.core.logprobs(samples)

    def export_adapter(self, name: str) -> dict[str, Tensor]:
        return self.core.export_adapter(name)

    def export_for_push(self, name: str) -> RankExport:
        """`export_adapter` and what an engine needs to receive it (the rank keeps the tensors
        for its broadcasts: `broadcast_export`)."""
        tensors = self.core.export_adapter(name)
        return self._kept(name, RankExport(tensors, ExportDescription.of(
            tensors, self.core.peft_config(self.core.loaded(name).spec))))

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def fresh_export_for_push(self, spec: AdapterSpec) -> RankExport:
        """What `export_for_push` will give once `load_adapter(spec)` has put the fresh adapter
        in its slot, computed without touching the model: on the push thread, so a
        registration can reach the engines while a train call runs."""
        tensors = self.core.fresh_export(spec)
        return self._kept(spec.name, RankExport(tensors, ExportDescription.of(tensors, self.core.peft_config(spec))))

    def _kept(self, adapter: str, export: RankExport) -> RankExport:
        if export.tensors:  # a rank that does not write exports nothing to keep
            self.sender.keep(adapter, export.description.export_id, export.tensors)
        return export

    def optimizer_state(self, name: str) -> OptimizerState:
        return self.core.optimizer_state(name)

    def schedule_state(self, name: str) -> dict[str, Any]:
        return self.core.schedule_state(name)

    def accumulated_grad(self, name: str) -> GradShare:
        return self.core.accumulated_grad(name)

    def save_client_state(self, name: str, directory: str, pending: dict[str, Tensor] | None = None) -> str:
        return self.core.save_client_state(name, directory, pending)

    def load_client_state(self, name: str, directory: str, optimizer: bool = True) -> None:
        self.core.load_client_state(name, directory, optimizer)

    def save_adapter(self, name: str, step: int, data_position: DataPosition | None = None,
                     accumulated: AccumulatedGrad | None = None) -> str:
        return self.core.save_adapter(name, step, data_position, accumulated)
