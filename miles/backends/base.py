"""The contract between the driver and a training backend: all the driver knows of one.

A training backend holds the frozen base model, the slot page table and one optimizer
per slot, spread over its ranks. It does the math and nothing else: it never talks to
the controller, keeps no lifecycle state and counts no steps for anyone. The adapter
lifecycle (which adapter goes in which slot, when to push, when to save, under which
step number) is orchestrated once, backend-neutral, by the loop's stages (`miles.main.stages`) on the
iteration's snapshot.

    backend: TrainingBackend = torch_train_group(TrainGroupConfig.from_config(cfg))
    await backend.start()
    loaded = await backend.load_adapter(AdapterSpec.from_run(run))   # fresh or resumed
    result = await backend.train(rollout_id, batch)                  # forward + backward
    steps = await backend.step_adapters(batch.step_names)            # those slots only
    # client-driven adapters (Tinker): their datums in the same call, their own Adam settings
    result = await backend.train(rollout_id, batch, client=[work])   # result.client[0]: one DatumOutput per datum
    steps = await backend.step_adapters(["sft-1"], adam={"sft-1": AdamStep(learning_rate=1e-4)})
    export = await backend.export_adapter(name)                      # for a weight push
    # in-place pushes: the exporting rank joins a weights-update group with every engine
    host, port = await backend.update_group_endpoint()
    await asyncio.gather(backend.join_update_group(spec), <the engine joins spec>)   # one group per engine
    failed = await backend.broadcast_adapter(export, [spec.group_name, ...])   # while each engine receives
    await backend.leave_update_group(spec.group_name)
    await backend.save_adapter(SaveRequest(name, step, data_position))
    backend.latest_checkpoint(save_dir)                              # where a load would resume
    await backend.cleanup_adapter(name)
    await backend.shutdown()

Arguments and results are the dataclasses below (picklable; never string-keyed dicts).
To add a backend (e.g. Megatron), implement `TrainingBackend` and build it in
`miles.main.launch.launch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles.utils.adapter_config import resolved_field
from miles.utils.loss_settings import LossSettings
from miles.utils.types import DataPosition, RolloutBatch
from miles.utils.types.client import AdamStep, ClientWork, DatumOutput
from miles.utils.types.client_commands import LoraGroup

if TYPE_CHECKING:
    from miles.lora.weight_sync import UpdateGroupSpec
    from miles.utils.types import AdapterRun
    from miles.utils.types.client_commands import ClientAdapterRun


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter as a backend sees it: its slot, LoRA shape and optimizer settings."""

    name: str
    slot: int
    rank: int
    alpha: float
    global_batch_size: int
    """rollout_batch_size * n_samples_per_prompt: the gradient is divided by it at step."""
    rollout_batch_size: int | None = None
    """Prompt groups per step; a resumed part-window gradient is kept only if it covers fewer
    (and `global_batch_size / rollout_batch_size` samples each). None: only `global_batch_size` is checked."""
    lr: float = 1e-4
    weight_decay: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_steps: int = 0
    num_step: int | None = None
    """Steps this registration trains for (decaying schedules end there)."""
    start_step: int | None = None
    """Step this registration started at, once fixed (it was pushed before: a trainer that
    restarted over the registry); None: the step it loads at."""
    registration_id: str = ""
    save_dir: str | None = None
    """Where its checkpoints live (`{save_dir}/checkpoints/step_N`); None: never saved."""
    loss: LossSettings | None = None
    """Its loss and advantage settings (the trainer's flags with its `loss:` keys); None: the trainer's."""
    seed: int | None = None
    """Seed of its fresh init (a client's `create_model` seed); None: drawn from the trainer's
    `--seed` and its name."""
    frozen: frozenset[LoraGroup] = frozenset()
    """LoRA groups it never trains (a client's layout: `train_attn=False`, ...): their B stays
    zero and the optimizer never touches their rows (weights or moments), so on those layers it
    is the base model; its exports and checkpoints list only the layers it trains."""

    def final_step(self, loaded_step: int) -> int | None:
        """The step its decaying LR schedule ends at, for weights loaded at `loaded_step`."""
        if self.num_step is None:
            return None
        return (loaded_step if self.start_step is None else self.start_step) + self.num_step

    @classmethod
    def for_client(cls, run: ClientAdapterRun) -> AdapterSpec:
        """A client-driven adapter (a Tinker model): its rank, alpha and seed; no schedule,
        no batch scale (its `AdamStep`s set each step) and no periodic saves (its client's
        `save_state` writes where it asks)."""
        return cls(name=run.name, slot=run.slot, rank=run.config.rank, alpha=float(run.config.alpha),
                   global_batch_size=1, registration_id=run.registration_id, seed=run.config.seed,
                   frozen=run.config.frozen_groups())

    @classmethod
    def from_run(cls, run: AdapterRun) -> AdapterSpec:
        cfg = run.config
        return cls(
            name=run.name, slot=run.slot, rank=resolved_field(cfg.rank, "rank"),
            alpha=float(resolved_field(cfg.alpha, "alpha")),
            global_batch_size=cfg.adapter_global_batch_size,
            rollout_batch_size=resolved_field(cfg.rollout_batch_size, "rollout_batch_size"),
            lr=resolved_field(cfg.lr, "lr"), weight_decay=resolved_field(cfg.weight_decay, "weight_decay"),
            lr_decay_style=resolved_field(cfg.lr_decay_style, "lr_decay_style"),
            lr_warmup_steps=resolved_field(cfg.lr_warmup_steps, "lr_warmup_steps"), num_step=cfg.num_step,
            start_step=run.start_step if run.pushed else None,
            registration_id=run.registration_id, save_dir=None if cfg.save is None else str(cfg.save),
            loss=None if cfg.loss is None else cfg.loss_settings(),
        )


@dataclass(frozen=True)
class LoadResult:
    """What loading an adapter into its slot found."""

    checkpoint: Path | None = None
    """The checkpoint it resumed from; None when it started fresh."""
    step: int = 0
    """The step recorded in that checkpoint (0 when fresh): the registry takes it over."""
    data_position: DataPosition | None = None
    """Where its dataset stood at that checkpoint; None when fresh or not recorded."""
    accumulated_groups: int = 0
    """Groups toward the next step whose gradient the checkpoint held and the slot holds
    again: the registry takes the count over."""
    miles_checkpoint: bool = False
    """`checkpoint` was written by Miles' trainer: only its LoRA weights were loaded (a fresh
    optimizer and LR clock, the data from its start), at its step."""


@dataclass(frozen=True)
class AdapterTrainStats:
    """One adapter's share of one train call, over all ranks (means per sample)."""

    samples: int
    loss: float
    clip_fraction: float
    """Fraction of response tokens whose ratio was clipped."""
    kl: float
    tis_weight: float

    def to_metrics(self) -> dict[str, float]:
        return {"loss": self.loss, "clip_fraction": self.clip_fraction, "kl": self.kl,
                "tis_weight": self.tis_weight, "train_samples": float(self.samples)}


@dataclass(frozen=True)
class TrainResult:
    """One train call (forward and backward; no optimizer step)."""

    samples: int = 0
    adapters: dict[str, AdapterTrainStats] = field(default_factory=dict)
    """Server-driven adapters' stats."""
    client: list[list[DatumOutput]] = field(default_factory=list)
    """One list per `ClientWork` of the call, in order: each datum's outputs, in order."""


@dataclass(frozen=True)
class AdapterStepStats:
    """One adapter's optimizer step."""

    grad_norm: float
    """Norm of the scaled gradient before clipping."""
    lr: float

    def to_metrics(self) -> dict[str, float]:
        return {"grad_norm": self.grad_norm, "lr": self.lr}


@dataclass(frozen=True)
class LoraExport:
    """A slot's LoRA weights, ready to push to the engines.

    `tensors` is a `{PEFT parameter name: tensor}` dict (rank-sliced, never base
    weights) or a Ray ObjectRef to one, so every engine reads it from the object store.
    """

    peft_config: dict[str, Any]
    """Contents of `adapter_config.json`."""
    tensors: Any
    names: list[str] = field(default_factory=list)
    """The tensors' names, dtypes and shapes in broadcast order (the body of an in-place push)."""
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    nbytes: int = 0
    """Bytes of the tensors: what one push sends to each engine."""
    export_id: str = ""
    """Names the export on the train rank that made it (which keeps it to broadcast)."""


@dataclass(frozen=True)
class SaveRequest:
    """Write `{save_dir}/checkpoints/step_{step}` of a loaded adapter."""

    name: str
    step: int
    """The adapter's step as the registry counts it (the snapshot's `AdapterRun.step`)."""
    data_position: DataPosition | None = None
    """Recorded in `trainer_state.json` so a resume continues the dataset there."""
    accumulated_groups: int = 0
    """Groups trained toward step `step + 1` (the snapshot's `AdapterRun.accumulated_groups`):
    when > 0 their gradient is saved with the checkpoint, if the backend holds exactly
    `accumulated_samples` samples of it (else it is dropped with a warning)."""
    accumulated_samples: int = 0


class TrainRankLostError(RuntimeError):
    """A train rank is gone (its process died). The adapters' weights and optimizer state
    are still on the surviving ranks (DP replicas hold identical copies), so they can be
    saved; the backend cannot train any more."""


@runtime_checkable
class TrainingBackend(Protocol):
    """What the driver calls on a training backend. Every method but `latest_checkpoint` (a
    read of the save directory) is a coroutine."""

    async def start(self) -> None:
        """Create the ranks and load the base model."""

    async def load_adapter(self, spec: AdapterSpec) -> LoadResult:
        """Put an adapter into `spec.slot` (which must be empty): from the latest complete
        checkpoint under `spec.save_dir` if there is one (with the gradient of its accumulated
        groups, if it holds one), else fresh (A random, B zero)."""

    async def cleanup_adapter(self, name: str) -> None:
        """Empty the adapter's slot: weights, optimizer moments and counters, retained
        gradients, LR schedule. Saving first is the caller's business."""

    async def export_adapter(self, name: str) -> LoraExport:
        """The adapter's current LoRA tensors for a weight push."""

    async def fresh_export(self, spec: AdapterSpec) -> LoraExport | None:
        """What `export_adapter` will give once `load_adapter(spec)` has loaded the adapter,
        when that load is fresh (None when a checkpoint under `spec.save_dir` would resume it).
        Touches no slot and may run while a train call does: the driver pushes a new
        registration to the engines without waiting for the loop's next iteration."""

    async def update_group_endpoint(self) -> tuple[str, int]:
        """Host and free port where the exporting rank hosts a weights-update group's rendezvous
        (its node's address when the cluster has more than one node, else loopback)."""

    async def join_update_group(self, spec: UpdateGroupSpec) -> None:
        """The exporting rank joins `spec` as rank 0 (returns once every engine rank of it joined
        too); a group of the same name it was in before is left first."""

    async def leave_update_group(self, group_name: str | None = None) -> None:
        """The exporting rank leaves that weights-update group (None: every one it is in)."""

    async def broadcast_adapter(self, export: LoraExport, group_names: Sequence[str], *,
                                bucketed: bool = False) -> dict[str, str]:
        """The exporting rank broadcasts `export.tensors` over each named group in turn, in
        `export.names` order (`bucketed`: one flat tensor per dtype,
        `weight_sync.broadcast_tensors`), while the engines receive them; returns the groups
        whose broadcast failed (a dead engine), with the error."""

    async def train(self, rollout_id: int, batch: RolloutBatch, client: Sequence[ClientWork] = ()) -> TrainResult:
        """Forward and backward of a batch and of the client datums of `client` (every adapter
        in them must be loaded; the batch may be empty); the gradients accumulate per slot
        until that adapter steps. A `ClientWork` with `backward=False` (a `forward`) only
        scores its datums. If it raises, no rank keeps any part of the call (gradients, LR
        clocks); a dead rank raises `TrainRankLostError`."""

    async def step_adapters(self, names: list[str],
                            adam: dict[str, AdamStep] | None = None) -> dict[str, AdapterStepStats]:
        """Optimizer step of exactly these adapters; every other slot is untouched. An adapter
        given an `AdamStep` (a client's `optim_step`) steps with its settings and an unscaled
        gradient; the others with their schedule, batch scale and `--clip-grad`."""

    async def save_client_state(self, name: str, directory: str, *, pending: bool = False) -> Path:
        """A client's `save_state`: the adapter's weights (PEFT) and optimizer state written to
        `directory` itself, atomically (its pending gradient is not saved). With `pending` (a
        page-out of an idle model, `--multi-lora-idle-evict-s`) the gradient of its
        forward_backward calls not yet stepped and its LR clock are written too."""

    async def load_client_state(self, name: str, directory: str, *, optimizer: bool = True) -> None:
        """A client's `load_state`: weights from a `save_client_state` directory into the loaded
        adapter's slot, with its optimizer state when `optimizer` (else fresh moments); any
        pending gradient is dropped, unless the directory is a page-out's: then the model is
        back exactly as it was paged out (weights, moments, pending gradient, clock)."""

    async def save_adapter(self, request: SaveRequest) -> Path:
        """Write a checkpoint of a loaded adapter, with the gradient of its accumulated groups
        summed over ranks when `request.accumulated_groups > 0`; returns its directory."""

    def latest_checkpoint(self, save_dir: str | Path) -> Path | None:
        """The latest complete checkpoint under an adapter's save directory (the one
        `load_adapter` resumes from), or None."""

    async def shutdown(self) -> None:
        """Stop the ranks."""
