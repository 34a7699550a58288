"""One data-parallel rank of the torch training backend.

A frozen Hugging Face causal LM with the slot page table injected, one AdamW per slot
(`SlotAdamW`) and one LR schedule per adapter. `TrainGroup` runs one of these per DP
rank as a Ray actor; it is a plain class, so a single rank can be driven in-process:

    actor = TorchTrainActor(TrainActorConfig(hf_checkpoint="/tmp/tiny", n_slots=4, lora_rank=8))
    actor.load_adapter(AdapterSpec(name="math", slot=0, rank=8, alpha=16.0, global_batch_size=8))
    actor.train(samples, advantages, samples_per_adapter={"math": 8})
    actor.step_adapters(["math"])

Every sample enters the gradient with weight 1 and a slot's gradients persist across
train calls until that adapter steps; at step time the stepping slots' gradients are
summed over ranks, scaled by `1 / adapter_global_batch_size`, clipped by the slot's own
norm and applied to that slot only. A rank counts no adapter steps (the registry owns
them; a save is named by the step it is given); only AdamW's bias-correction count and
the LR schedule's sample clock live here.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import Tensor

from miles.lora import (
    clear_slot,
    export_peft_adapter,
    fresh_slot_weights,
    get_slot_weights,
    init_slot,
    inject_multi_lora,
    load_peft_adapter,
    lora_modules,
    peft_adapter_config,
    peft_tensors,
    use_slots,
)
from miles.backends.base import AdapterSpec, AdapterStepStats, LoadResult
from miles.lora.weight_sync import (
    UpdateGroupSpec,
    broadcast_tensors,
    join_update_group,
    leave_update_group,
    listening_store,
    tensor_metadata,
)
from miles.backends.torch.batching import (
    CPU_ACTIVATION_BUDGET_MB,
    ActivationBudget,
    Advantage,
    MicroBatch,
    activation_bytes_per_token,
    logits_to_keep,
    make_micro_batches,
    next_token_logprobs,
    response_logprobs,
)
from miles.backends.torch.checkpoint import (
    AccumulatedGrad,
    Checkpoint,
    OptimizerState,
    TrainerState,
    read_checkpoint,
    write_checkpoint,
)
from miles.backends.torch.lm_head import CHUNK_LOGITS, fused_head_weight, lm_head_logprobs
from miles.backends.torch.loss import (
    LossConfig,
    LossParams,
    approx_kl_per_sample,
    entropy_from_logits,
    policy_loss_terms,
)
from miles.backends.torch.lr_schedule import LRSchedule
from miles.backends.torch.optimizer import SlotAdamW, SlotStep
from miles.backends.torch.recompute import apply_recompute
from miles.backends.torch.allocator import keep_freed_memory
from miles.utils.arguments import MilesConfig
from miles.utils.loss_settings import LossSettings
from miles.utils.network import cluster_host
from miles.utils.types import DataPosition, Sample

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHT_PUSH = "weight_push"
"""The Ray concurrency group of the weights-update group's methods."""
WINDOW_MIN_SKIPPED_LOGITS = 2**16
"""The forward computes logits on the response window only when that skips at least this
many logits (rows x prompt positions x vocabulary): below it the LM head costs nothing
worth a gather, and small GEMMs of another row count round differently."""
FUSED_HEAD_MIN_LOGITS = CHUNK_LOGITS
"""The LM head is fused with the logprobs (`lm_head_logprobs`) when the window's logits
(rows x positions x vocabulary) exceed one chunk of it: below that the logits take no more
memory than the fused head's chunk buffers, and the model's own head keeps its numbers."""


@dataclass(frozen=True)
class TrainActorConfig:
    """What one train rank needs: the model, the page table, the optimizer and the loss."""

    hf_checkpoint: str
    n_slots: int
    lora_rank: int
    target_modules: str = "all-linear"
    device: str = "cpu"
    dtype: str = "float32"
    micro_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    """A token budget per forward (`--use-dynamic-batch-size --max-tokens-per-gpu`): rows x
    longest row of each micro-batch stay within it; `micro_batch_size` is then not used."""
    activation_budget_mb: float | None = None
    """Given neither of those, a train call is cut into micro-batches whose activations
    (`activation_bytes_per_token`) stay near this many MiB (`--activation-budget-mb`);
    None: `CPU_ACTIVATION_BUDGET_MB` on CPU and the whole batch on CUDA; 0: the whole batch."""
    recompute_granularity: str | None = None
    """Activation recomputation, Megatron's names: "full" (whole decoder layers) or
    "selective" (here: the norm outputs and gated activations, `release_cheap_activations`);
    None keeps every activation."""
    recompute_method: str | None = None
    """With "full": "uniform" (every layer) or "block" (the first `recompute_num_layers`)."""
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None
    """With "selective": Megatron's module names (`--recompute-modules`); None: layernorm."""
    num_threads: int | None = None
    """torch threads of a CPU rank (`--actor-num-cpus-per-worker`); None leaves torch's count."""
    seed: int = 42
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    min_lr: float = 0.0
    loss: LossSettings = field(default_factory=LossSettings)
    """The trainer's loss flags (`cfg.loss`): the settings of adapters whose spec has none.
    A `LossConfig` is accepted and read as the settings it implements."""
    fault_train_calls: frozenset[tuple[int, int]] = frozenset()
    """Test only: (rank, call) pairs; that rank's call-th train call (1-based) raises
    `InjectedTrainFault` after its first micro-batch's backward; rank -1 means every rank.
    Set from `MILES_TEST_FAULT_TRAIN_CALLS`: "2,5" (every rank) or "1:2" (rank 1 only)."""

    def __post_init__(self) -> None:
        if isinstance(self.loss, LossConfig):
            object.__setattr__(self, "loss", self.loss.to_settings())

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> TrainActorConfig:
        if not cfg.hf_checkpoint:
            raise ValueError("--hf-checkpoint is required: the Hugging Face directory of the base model")
        return cls(
            hf_checkpoint=cfg.hf_checkpoint,
            n_slots=max(1, cfg.multi_lora_n_adapters),
            lora_rank=cfg.lora_rank,
            target_modules=cfg.target_modules,
            device=cfg.resolved_device,
            dtype=cfg.resolved_dtype,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens_per_micro_batch=cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None,
            activation_budget_mb=cfg.activation_budget_mb,
            recompute_granularity=cfg.recompute_granularity,
            recompute_method=cfg.recompute_method,
            recompute_num_layers=cfg.recompute_num_layers,
            recompute_modules=None if cfg.recompute_modules is None else tuple(cfg.recompute_modules),
            num_threads=cfg.actor_num_cpus_per_worker,
            seed=cfg.seed,
            adam_betas=(cfg.adam_beta1, cfg.adam_beta2),
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            min_lr=cfg.min_lr,
            loss=cfg.loss,
            fault_train_calls=fault_train_calls_from_env(),
        )


FAULT_TRAIN_CALLS_ENV = "MILES_TEST_FAULT_TRAIN_CALLS"


class InjectedTrainFault(RuntimeError):
    """Raised by a train call named in `TrainActorConfig.fault_train_calls` (tests only)."""


def fault_train_calls_from_env() -> frozenset[tuple[int, int]]:
    out = set()
    for part in os.environ.get(FAULT_TRAIN_CALLS_ENV, "").split(","):
        rank, _, call = part.strip().rpartition(":")
        if call:
            out.add((int(rank) if rank else -1, int(call)))
    return frozenset(out)


@dataclass
class LossSums:
    """Sums over one rank's samples of one adapter; `TrainGroup` adds ranks and divides."""

    loss_sum: float = 0.0
    samples: int = 0
    clipped_tokens: float = 0.0
    tokens: float = 0.0
    kl_sum: float = 0.0
    tis_sum: float = 0.0

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(
            self.loss_sum + other.loss_sum, self.samples + other.samples, self.clipped_tokens + other.clipped_tokens,
            self.tokens + other.tokens, self.kl_sum + other.kl_sum, self.tis_sum + other.tis_sum,
        )


@dataclass
class _Loaded:
    spec: AdapterSpec
    schedule: LRSchedule


@dataclass
class _BatchUndo:
    """What the latest train call changed, so it can be taken back until a step."""

    grads: dict[int, list[Tensor] | None]
    """Slot -> copies of its gradients before the call; None when they were all zero
    (the first call after a step: no copy is held, the undo zeroes them)."""
    samples_seen: dict[str, int]
    """Adapter -> its LR clock before the call."""


def adapter_seed(seed: int, name: str) -> int:
    """Seed of an adapter's fresh init: the same on every rank and in every run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TorchTrainActor:
    """One DP rank: frozen base + slot page table + per-slot AdamW + per-adapter schedules."""

    ray_concurrency_groups = {WEIGHT_PUSH: 1}
    """Ray runs the weights-update group's methods on a thread of their own, so a push can
    run behind the next train call (`--overlap-weight-push`); `TrainGroup` passes this to
    `ray.remote`."""
    _update_groups: dict[str, tuple[dist.ProcessGroup, str]] = {}
    """Weights-update groups this rank sends LoRA tensors over (rank 0 only): name -> (group, backend).
    Replaced by an instance dict at the first join."""
    _rendezvous: dict[int, dist.TCPStore] = {}
    """Stores listening for a group this rank hosts and has not joined yet: port -> store.
    Replaced by an instance dict at the first one."""

    def __init__(self, config: TrainActorConfig, rank: int = 0, world_size: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            if config.num_threads:  # the CPUs Ray reserved for this rank (it sets OMP_NUM_THREADS alike)
                torch.set_num_threads(config.num_threads)
        model = AutoModelForCausalLM.from_pretrained(config.hf_checkpoint, dtype=DTYPES[config.dtype])
        self.module_names = inject_multi_lora(
            model, n_slots=config.n_slots, max_rank=config.lora_rank, target_modules=config.target_modules
        )
        # eval(): no dropout, so the logprobs of a pass equal the ones the loss uses as "old".
        self.model = model.to(self.device).eval()
        apply_recompute(self.model, config.recompute_granularity, config.recompute_method,
                        config.recompute_num_layers, config.recompute_modules)
        modules = lora_modules(self.model)
        # LoRA weights and their AdamW moments stay fp32 over a bf16 base: updates of
        # lr ~ 1e-4 would round away in bf16.
        for module in modules.values():
            module.lora_A.data = module.lora_A.data.float()
            module.lora_B.data = module.lora_B.data.float()
        self.param_names: list[str] = []
        params: list[tuple[torch.nn.Parameter, int]] = []
        for name, module in modules.items():
            self.param_names += [f"{name}.lora_A", f"{name}.lora_B"]
            params += [(module.lora_A, 1), (module.lora_B, 2)]
        self.optimizer = SlotAdamW(params, n_slots=config.n_slots, betas=config.adam_betas, eps=config.adam_eps)
        self.target_short_names = sorted({n.rsplit(".", 1)[-1] for n in self.module_names})
        self.adapters: dict[str, _Loaded] = {}
        self._train_calls = 0
        self._undo: _BatchUndo | None = None
        budget_mb = config.activation_budget_mb
        if budget_mb is None:
            budget_mb = CPU_ACTIVATION_BUDGET_MB if self.device.type == "cpu" else 0
        self._activation_budget = ActivationBudget(int(budget_mb * 2**20), activation_bytes_per_token(
            self.model.config, torch.finfo(DTYPES[config.dtype]).bits // 8, config.recompute_granularity,
        )) if budget_mb else None

    # ---- distributed set-up -------------------------------------------------------

    def ready(self) -> int:
        """The rank's torch threads, once it is built."""
        return torch.get_num_threads()

    def master_address(self, host: str | None = None) -> str:
        """The process group's rendezvous address (called on rank 0): on `host`, by default this
        node's address when the cluster has more than one node, else loopback. The port is
        held from now until `init_process_group`."""
        host = host or cluster_host()
        return f"tcp://{host}:{self._listen(host)}"

    def _listen(self, host: str) -> int:
        store = listening_store(host)
        self._rendezvous = {**self._rendezvous, store.port: store}
        return store.port

    def init_process_group(self, address: str, timeout_s: float = 600.0) -> None:
        if self.world_size == 1:
            return
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
        self.leave_update_group()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- weights-update group (the exporting rank: rank 0) ---------------------------

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def update_group_endpoint(self) -> tuple[str, int]:
        """Host and port for a weights-update group's rendezvous on this rank's node; the port is
        held from now until `join_update_group`."""
        host = cluster_host()
        return host, self._listen(host)

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def join_update_group(self, spec: UpdateGroupSpec) -> None:
        """Join `spec` as its sender (rank 0); blocks until every engine rank of it joined."""
        self.leave_update_group(spec.group_name)
        group = join_update_group(spec, 0, store=self._rendezvous.pop(spec.master_port, None))
        self._update_groups = {**self._update_groups, spec.group_name: (group, spec.backend)}

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def leave_update_group(self, group_name: str | None = None) -> None:
        """Leave one weights-update group (every one when `group_name` is None)."""
        names = list(self._update_groups) if group_name is None else [group_name]
        for name in names:
            entry = self._update_groups.get(name)
            self._update_groups = {k: v for k, v in self._update_groups.items() if k != name}
            if entry is not None:
                leave_update_group(entry[0])

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def broadcast_tensors(self, tensors: dict[str, Tensor], group_names: Sequence[str],
                          bucketed: bool = False) -> dict[str, str]:
        """Send `tensors` (an export of this rank) over each named group in turn (`bucketed`: one
        flat tensor per dtype); returns the groups whose broadcast failed, with the error (one
        dead engine does not stop the others' pushes)."""
        failed = {}
        for name in group_names:
            if name not in self._update_groups:
                failed[name] = "not joined"
                continue
            group, backend = self._update_groups[name]
            try:
                broadcast_tensors(group, tensors, device=self.device if backend == "nccl" else None, bucketed=bucketed)
            except RuntimeError as exc:  # gloo/nccl: the peer is gone
                failed[name] = str(exc)
        return failed

    @staticmethod
    def tensor_metadata(tensors: dict[str, Tensor]) -> tuple[list[str], list[str], list[list[int]], int]:
        """(names, dtypes, shapes, bytes) of an export, for the engines' side of a broadcast."""
        names, dtypes, shapes = tensor_metadata(tensors)
        return names, dtypes, shapes, sum(t.numel() * t.element_size() for t in tensors.values())

    # ---- adapters in slots ----------------------------------------------------------

    def load_adapter(self, spec: AdapterSpec, checkpoint: str | None = None) -> LoadResult:
        """Put an adapter into its slot, fresh (A seeded by seed and name, B zero) or resumed
        from a checkpoint directory; says which step and data position it resumed at."""
        self._check_free(spec)
        self.optimizer.reset_slot(spec.slot)
        schedule = self._new_schedule(spec)
        result = LoadResult()
        if checkpoint is None:
            self._init_slot(spec, torch.Generator().manual_seed(adapter_seed(self.config.seed, spec.name)))
        else:
            result, schedule = self._resume(spec, Path(checkpoint), schedule)
        self.optimizer.configure_slot(spec.slot, rank=spec.rank, lr=spec.lr, weight_decay=spec.weight_decay)
        if spec.num_step is not None:
            # `num_step` counts from the step this registration started at.
            schedule.total_steps = spec.final_step(result.step)
        self.adapters[spec.name] = _Loaded(spec=spec, schedule=schedule)
        return result

    def _init_slot(self, spec: AdapterSpec, generator: torch.Generator) -> None:
        """A fresh adapter in its slot: A seeded by `generator`, B zero."""
        init_slot(self.model, spec.slot, rank=spec.rank, alpha=spec.alpha, generator=generator)

    def _fresh_weights(self, spec: AdapterSpec, generator: torch.Generator) -> dict[str, tuple[Tensor, Tensor]]:
        """What `_init_slot` writes, per module name, not written."""
        return fresh_slot_weights(self.model, rank=spec.rank, generator=generator)

    def _load_slot_weights(self, spec: AdapterSpec, path: Path) -> None:
        """The LoRA weights of the PEFT directory `path` into the adapter's slot."""
        load_peft_adapter(self.model, spec.slot, path)

    def _check_free(self, spec: AdapterSpec) -> None:
        if spec.name in self.adapters:
            raise ValueError(f"adapter '{spec.name}' is already loaded in slot {self.adapters[spec.name].spec.slot}")
        for other in self.adapters.values():
            if other.spec.slot == spec.slot:
                raise ValueError(f"slot {spec.slot} is held by adapter '{other.spec.name}': clean it up first")
        self._check_rank(spec)

    def _check_rank(self, spec: AdapterSpec) -> None:
        if not 0 < spec.rank <= self.config.lora_rank:
            raise ValueError(f"adapter '{spec.name}' has rank {spec.rank}; it must be in 1..{self.config.lora_rank} (--lora-rank)")

    def _new_schedule(self, spec: AdapterSpec) -> LRSchedule:
        return LRSchedule(
            lr=spec.lr, samples_per_step=spec.global_batch_size, style=spec.lr_decay_style,  # type: ignore[arg-type]
            warmup_steps=spec.lr_warmup_steps, min_lr=self.config.min_lr,
        )

    def _resume(self, spec: AdapterSpec, path: Path, fresh: LRSchedule) -> tuple[LoadResult, LRSchedule]:
        ckpt = read_checkpoint(path)
        if ckpt.trainer_state.rank != spec.rank or abs(ckpt.trainer_state.alpha - spec.alpha) > 1e-6:
            raise ValueError(
                f"checkpoint {path} holds a rank-{ckpt.trainer_state.rank} alpha-{ckpt.trainer_state.alpha} adapter "
                f"but adapter '{spec.name}' is configured with rank {spec.rank} alpha {spec.alpha}: "
                "use the checkpoint's rank and alpha, or give the adapter a fresh save directory"
            )
        self._load_slot_weights(spec, path)
        exp_avg = self._pad_moments(ckpt.optimizer.exp_avg, spec, path)
        exp_avg_sq = self._pad_moments(ckpt.optimizer.exp_avg_sq, spec, path)
        self.optimizer.load_slot_state(spec.slot, exp_avg, exp_avg_sq, ckpt.optimizer.step)
        # The clock comes from the checkpoint; the schedule's settings from today's config.
        saved = LRSchedule.from_state_dict(ckpt.scheduler)
        schedule = replace(fresh, samples_seen=saved.samples_seen, samples_at_last_step=saved.samples_at_last_step)
        result = LoadResult(checkpoint=path, step=ckpt.trainer_state.step,
                            data_position=ckpt.trainer_state.data_position,
                            accumulated_groups=self._restore_accumulated_grad(spec, ckpt, schedule))
        return result, schedule

    def _restore_accumulated_grad(self, spec: AdapterSpec, ckpt: Checkpoint, schedule: LRSchedule) -> int:
        """Put a checkpoint's part-window gradient back into the slot; returns the groups it
        covers. The first DP replica holds the whole sum and the others zeros, so the step's
        all-reduce gives the sum the interrupted run would have had."""
        acc = ckpt.accumulated_grad
        if acc is None:
            return 0
        rbs = spec.rollout_batch_size
        fits = acc.samples < spec.global_batch_size and \
            (rbs is None or (acc.groups < rbs and acc.samples == acc.groups * (spec.global_batch_size // rbs)))
        if not fits:
            logger.warning("Adapter '%s': the gradient of %d group(s) (%d samples) in %s does not fit its batch "
                           "(%s groups, %d samples per step) as configured now; it is dropped and the step's "
                           "window starts empty", spec.name, acc.groups, acc.samples, ckpt.path, rbs,
                           spec.global_batch_size)
            schedule.samples_seen = schedule.samples_at_last_step
            return 0
        if self._first_replica():
            grads = self._pad_moments(acc.tensors, spec, ckpt.path, what="accumulated gradient")
            torch._foreach_copy_(self.optimizer.slot_grads(spec.slot), grads)
        return acc.groups

    def _first_replica(self) -> bool:
        """This rank belongs to data-parallel replica 0."""
        return self.rank == 0

    def _pad_moments(self, tensors: dict[str, Tensor], spec: AdapterSpec, path: Path,
                     what: str = "optimizer state") -> list[Tensor]:
        out = []
        for name, (param, rank_dim) in zip(self.param_names, self.optimizer.params):
            if name not in tensors:
                raise ValueError(f"checkpoint {path} has no {what} for {name}: it was saved for another model")
            full = torch.zeros_like(param[spec.slot])
            region = full.narrow(rank_dim - 1, 0, spec.rank)
            if tensors[name].shape != region.shape:
                raise ValueError(f"checkpoint {path}: {what} {name} has shape {list(tensors[name].shape)}, expected {list(region.shape)}")
            region.copy_(tensors[name])
            out.append(full)
        return out

    def cleanup_adapter(self, name: str) -> None:
        """Empty the adapter's slot: weights, moments, step counter, retained grads, schedule."""
        loaded = self._loaded(name)
        clear_slot(self.model, loaded.spec.slot)
        self.optimizer.reset_slot(loaded.spec.slot)
        del self.adapters[name]
        self._undo = None

    def loaded_adapters(self) -> dict[str, int]:
        return {name: a.spec.slot for name, a in self.adapters.items()}

    def _loaded(self, name: str) -> _Loaded:
        if name not in self.adapters:
            raise KeyError(f"adapter '{name}' is not loaded on train rank {self.rank}: reconcile adapters first")
        return self.adapters[name]

    # ---- training -------------------------------------------------------------------

    def train(
        self, samples: Sequence[Sample], advantages: Sequence[Advantage], samples_per_adapter: dict[str, int]
    ) -> dict[str, LossSums]:
        """Forward and backward this rank's samples (gradients accumulate per slot).

        `advantages[i]` is sample i's advantage: one value, or one per response token
        (the reinforce++ estimators).

        `samples_per_adapter` counts each adapter's samples in the whole (all-rank)
        batch; it advances the adapters' LR clocks identically on every rank.
        """
        for sample in samples:
            loaded = self._loaded(sample.adapter)
            if sample.slot != loaded.spec.slot:
                raise ValueError(f"sample of adapter '{sample.adapter}' names slot {sample.slot}, but the adapter is in slot {loaded.spec.slot}")
        for name in samples_per_adapter:
            self._loaded(name)
        stats: dict[str, LossSums] = {}
        need_rollout = any(self._loss_settings(name).needs_rollout_logprobs for name in {s.adapter for s in samples})
        batches = self._micro_batches(samples, advantages, need_rollout_logprobs=need_rollout,
                                      max_tokens=self._budget_tokens(samples))
        self._remember_batch({s.adapter for s in samples} | set(samples_per_adapter))
        self._train_calls += 1
        try:
            for i, batch in enumerate(batches):
                self._train_micro_batch(batch.to(self.device), stats)
                if i == 0 and self._fault_due():
                    raise InjectedTrainFault(f"injected fault in train call {self._train_calls} of rank {self.rank}")
            for name, n in samples_per_adapter.items():
                self.adapters[name].schedule.add_samples(n)
        except BaseException:
            self.discard_batch()
            raise
        return stats

    def _micro_batches(self, samples: Sequence[Sample], advantages: Sequence[Advantage], *,
                       need_rollout_logprobs: bool = False, max_tokens: int | None = None) -> list[MicroBatch]:
        return make_micro_batches(samples, advantages, self.config.micro_batch_size,
                                  max_tokens=self.config.max_tokens_per_micro_batch or max_tokens,
                                  need_rollout_logprobs=need_rollout_logprobs)

    def _budget_tokens(self, samples: Sequence[Sample]) -> int | None:
        """Tokens per training micro-batch under the activation budget, where no micro-batch
        size was given; None: the whole batch."""
        budget = self._activation_budget
        if budget is None or self.config.micro_batch_size or self.config.max_tokens_per_micro_batch:
            return None
        tokens = budget.max_tokens(samples)
        if tokens is not None and not budget.announced:
            budget.announced = True
            logger.info(
                "Training in micro-batches of up to %d tokens: about %.0f KiB a token stays for the backward, "
                "and --activation-budget-mb is %g (--micro-batch-size sets the split instead)",
                tokens, budget.bytes_per_token / 1024, budget.budget_bytes / 2**20)
        return tokens

    def _fault_due(self) -> bool:
        faults = self.config.fault_train_calls
        return (self.rank, self._train_calls) in faults or (-1, self._train_calls) in faults

    def _remember_batch(self, names: set[str]) -> None:
        slots = sorted({self.adapters[name].spec.slot for name in names})
        grads = {slot: self.optimizer.slot_grads(slot) for slot in slots}
        nonzero = self._slots_with_grads(slots)
        self._undo = _BatchUndo(
            grads={slot: [g.clone() for g in grads[slot]] if slot in nonzero else None for slot in slots},
            samples_seen={name: self.adapters[name].schedule.samples_seen for name in names},
        )

    def _slots_with_grads(self, slots: list[int]) -> set[int]:
        """Those of `slots` with a nonzero gradient: one check per parameter, not per slot."""
        if not slots or not self.optimizer.params:
            return set()
        nonzero_PS = torch.stack([param.grad.flatten(1).any(dim=1) for param, _ in self.optimizer.params])
        nonzero_S = nonzero_PS.any(dim=0).tolist()
        return {slot for slot in slots if nonzero_S[slot]}

    def discard_batch(self) -> None:
        """Take back the latest train call (its gradients and LR clock advance), unless an
        adapter stepped since; a failed call does this itself, and `TrainGroup` asks every
        rank when any rank failed, so the batch counts nowhere."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        for slot, saved in undo.grads.items():
            if saved is None:
                torch._foreach_zero_(self.optimizer.slot_grads(slot))
            else:
                torch._foreach_copy_(self.optimizer.slot_grads(slot), saved)
        for name, seen in undo.samples_seen.items():
            if name in self.adapters:
                self.adapters[name].schedule.samples_seen = seen

    def _forward_logprobs(self, batch: MicroBatch, slots: list[int], *, entropy: bool = False) -> Any:
        """Next-token logprobs [B, L-1]; with `entropy`, also the entropy of each of those
        next-token distributions [B, L-1].

        The LM head runs on the response window only (`logits_to_keep`): no logits, log-softmax
        or their gradients for prompt positions that predict no response token in any row.
        Positions before the window read 0 (logprob and entropy); every loss term and every
        caller reads response positions only, so the numbers are those of the full forward.
        Where the head is a plain linear (`fused_head_weight`) and the window's logits are
        large (`FUSED_HEAD_MIN_LOGITS`), it is fused with the logprobs (`lm_head_logprobs`):
        no [B, K, vocab] logits or gradient are ever held.
        """
        length, keep = batch.input_ids_BL.shape[1], logits_to_keep(batch)
        vocab = self.model.config.get_text_config().vocab_size
        if len(slots) * (length - keep) * vocab < WINDOW_MIN_SKIPPED_LOGITS:
            keep = length
        head_VH = fused_head_weight(self.model)
        if head_VH is not None and len(slots) * keep * vocab > FUSED_HEAD_MIN_LOGITS:
            with use_slots(self.model, slots):
                hidden_BLH = self.model.get_decoder()(
                    input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False,
                ).last_hidden_state
            start = length - keep  # position t predicts token t + 1; the last one predicts nothing
            out = lm_head_logprobs(hidden_BLH[:, start:-1], head_VH, batch.input_ids_BL[:, start + 1 :], entropy=entropy)
            if not entropy:
                return torch.nn.functional.pad(out, (start, 0))
            return tuple(torch.nn.functional.pad(x_BK, (start, 0)) for x_BK in out)
        # Positions as a tensor, not the int `keep`: the model gathers them into a contiguous
        # [B, K, H] block, one GEMM for the LM head; an int slices a strided view, which the
        # linear layer runs as a batched GEMM slower than the full head (CPU).
        window_K = torch.arange(length - keep, length, device=batch.input_ids_BL.device)
        with use_slots(self.model, slots):
            logits_BKV = self.model(
                input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False,
                logits_to_keep=window_K,
            ).logits
        logprobs_BT = next_token_logprobs(logits_BKV, batch.input_ids_BL)
        if not entropy:
            return logprobs_BT
        # kept position k predicts token L - keep + k + 1; the last kept one predicts nothing
        entropy_BT = entropy_from_logits(logits_BKV[:, :-1])
        return logprobs_BT, torch.nn.functional.pad(entropy_BT, (logprobs_BT.shape[1] - entropy_BT.shape[1], 0))

    def _loss_settings(self, adapter: str) -> LossSettings:
        return self._loaded(adapter).spec.loss or self.config.loss

    def _train_micro_batch(self, batch: MicroBatch, stats: dict[str, LossSums]) -> None:
        """Each sample's loss with its adapter's settings (`LossParams`), so a mixed batch
        gives every adapter the gradient it would get alone."""
        settings = [self._loss_settings(name) for name in batch.adapters]
        params = LossParams.gather(settings, list(range(len(settings)))).to(self.device)
        ref = None
        if any(s.use_kl_loss for s in settings):
            with torch.no_grad():
                ref = self._forward_logprobs(batch, [-1] * len(batch.slots))
        entropy = None
        if any(s.entropy_coef != 0 for s in settings):
            logprobs, entropy = self._forward_logprobs(batch, batch.slots, entropy=True)
        else:
            logprobs = self._forward_logprobs(batch, batch.slots)
        rollout = batch.rollout_logprobs_BT if any(s.needs_rollout_logprobs for s in settings) else None
        out = policy_loss_terms(
            logprobs, logprobs.detach(), batch.advantages_BT, batch.loss_mask_BT, params,
            rollout_logprobs_BT=rollout, ref_logprobs_BT=ref, entropy_BT=entropy, tis_args=self.config,
        )
        out.loss_B.sum().backward()
        clipped_B = out.pg_clipfrac_B * out.tokens_B
        rows = zip(batch.adapters, out.loss_B.tolist(), clipped_B.tolist(), out.tokens_B.tolist(),
                   out.kl_loss_B.tolist(), out.tis_B.tolist())
        for adapter, loss, clipped, tokens, kl, tis in rows:
            s = stats.setdefault(adapter, LossSums())
            s.loss_sum += loss
            s.samples += 1
            s.clipped_tokens += clipped
            s.tokens += tokens
            s.kl_sum += kl
            s.tis_sum += tis

    def step_adapters(self, names: Sequence[str]) -> dict[str, AdapterStepStats]:
        """Optimizer step of the given adapters only; every rank must call it with the same names."""
        names = sorted(names)
        loaded = [self._loaded(name) for name in names]
        self._undo = None  # a batch that stepped is kept
        self._all_reduce_slot_grads([a.spec.slot for a in loaded])
        lrs = {a.spec.name: a.schedule.begin_step() for a in loaded}
        norms = self.optimizer.step_slots(  # one fused pass over every stepping slot
            [SlotStep(slot=a.spec.slot, lr=lrs[a.spec.name], grad_scale=1.0 / a.spec.global_batch_size)
             for a in loaded],
            max_norm=self.config.clip_grad,
        )
        return {a.spec.name: AdapterStepStats(grad_norm=norms[a.spec.slot], lr=lrs[a.spec.name]) for a in loaded}

    def _all_reduce_slot_grads(self, slots: list[int]) -> None:
        if self.world_size == 1 or not slots:
            return
        grads = [g for slot in slots for g in self.optimizer.slot_grads(slot)]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def reward_kl(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Each sample's per-response-token KL of its adapter's policy to the base model
        (slot off), with its adapter's `--kl-loss-type`: the KL that `--kl-coef` subtracts
        from the reinforce++ token rewards. As in Miles the policy's logprobs are the
        engine's with `--use-rollout-logprobs`, else the trainer's before this step's update."""
        out: list[list[float]] = [[] for _ in samples]
        settings_by_adapter = {s.adapter: self._loss_settings(s.adapter) for s in samples}
        need_rollout = any(s.use_rollout_logprobs for s in settings_by_adapter.values())
        for batch in self._micro_batches(samples, [0.0] * len(samples), need_rollout_logprobs=need_rollout):
            batch = batch.to(self.device)
            settings = [settings_by_adapter[name] for name in batch.adapters]
            params = LossParams.gather(settings, list(range(len(settings)))).to(self.device)
            policy = self._forward_logprobs(batch, batch.slots).float()
            policy = torch.where(params.use_rollout_logprobs_B.view(-1, 1), batch.rollout_logprobs_BT, policy)
            base = self._forward_logprobs(batch, [-1] * len(batch.slots)).float()
            kl = approx_kl_per_sample(policy, base, params.kl_type_B)
            for index, values in zip(batch.indices, response_logprobs(kl, batch)):
                out[index] = values
        return out

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Each sample's response-token logprobs under its slot (in the given order)."""
        out: list[list[float]] = [[] for _ in samples]
        for batch in self._micro_batches(samples, [0.0] * len(samples)):
            batch = batch.to(self.device)
            for index, values in zip(batch.indices, response_logprobs(self._forward_logprobs(batch, batch.slots), batch)):
                out[index] = values
        return out

    # ---- export and checkpoints -----------------------------------------------------------

    def export_adapter(self, name: str) -> dict[str, Tensor]:
        """The adapter's LoRA tensors in PEFT names, sliced to its rank (CPU)."""
        return get_slot_weights(self.model, self._loaded(name).spec.slot)

    def export_for_push(self, name: str) -> tuple[dict[str, Tensor], tuple[dict[str, Any], list[str], list[str],
                                                                         list[list[int]], int]]:
        """`export_adapter` and what an engine needs to receive it: (PEFT config, names, dtypes,
        shapes, bytes). Called with two returns, the tensors stay in the object store."""
        tensors = self.export_adapter(name)
        return tensors, (self.peft_config(name), *self.tensor_metadata(tensors))

    @ray.method(concurrency_group=WEIGHT_PUSH)
    def fresh_export_for_push(self, spec: AdapterSpec) -> tuple[dict[str, Tensor], tuple[dict[str, Any], list[str],
                                                                                       list[str], list[list[int]], int]]:
        """What `export_for_push` will give once `load_adapter(spec)` has put the fresh adapter
        in its slot (the same seeded draws), computed without touching the model: on the push
        thread, so a registration can reach the engines while a train call runs."""
        self._check_rank(spec)
        generator = torch.Generator().manual_seed(adapter_seed(self.config.seed, spec.name))
        tensors = peft_tensors(self._fresh_weights(spec, generator))
        return tensors, (self._peft_config(spec), *self.tensor_metadata(tensors))

    def peft_config(self, name: str) -> dict[str, Any]:
        return self._peft_config(self._loaded(name).spec)

    def _peft_config(self, spec: AdapterSpec) -> dict[str, Any]:
        return peft_adapter_config(
            rank=spec.rank, alpha=spec.alpha, target_modules=self.target_short_names,
            base_model_name_or_path=self.config.hf_checkpoint,
        )

    def optimizer_state(self, name: str) -> OptimizerState:
        """The adapter's AdamW moments (rank-sliced, by LoRA parameter name) and step count."""
        spec = self._loaded(name).spec
        exp_avg, exp_avg_sq, step = self.optimizer.slot_state(spec.slot)
        sliced = lambda ts: {  # noqa: E731
            n: t.narrow(dim - 1, 0, spec.rank).contiguous().cpu()
            for n, t, (_, dim) in zip(self.param_names, ts, self.optimizer.params)
        }
        hyper = {"lr": spec.lr, "weight_decay": spec.weight_decay, "betas": list(self.optimizer.betas), "eps": self.optimizer.eps}
        return OptimizerState(exp_avg=sliced(exp_avg), exp_avg_sq=sliced(exp_avg_sq), step=step, hyper=hyper)

    def schedule_state(self, name: str) -> dict[str, Any]:
        return self._loaded(name).schedule.state_dict()

    def accumulated_grad(self, name: str) -> tuple[dict[str, Tensor], int]:
        """This rank's share of the adapter's gradient toward its next step (by LoRA parameter
        name, rank-sliced, CPU, not scaled), and the samples of all ranks trained toward
        that step (the LR clock's count, the same on every rank)."""
        a = self._loaded(name)
        spec = a.spec
        tensors = {n: g.narrow(dim - 1, 0, spec.rank).detach().cpu().clone()
                   for n, g, (_, dim) in zip(self.param_names, self.optimizer.slot_grads(spec.slot), self.optimizer.params)}
        return tensors, a.schedule.samples_seen - a.schedule.samples_at_last_step

    def _checkpoint_state(self, name: str, step: int, data_position: DataPosition | None,
                          accumulated: AccumulatedGrad | None) -> tuple[TrainerState, dict[str, Any]]:
        """`trainer_state.json` and `scheduler.json` of a save. Without a gradient the saved
        clock drops the samples trained since the last step, as the resumed window will."""
        a = self._loaded(name)
        spec = a.spec
        if spec.save_dir is None:
            raise ValueError(f"adapter '{name}' has no save directory: set 'save' in its config or --save")
        state = TrainerState(
            name=name, step=step, registration_id=spec.registration_id, rank=spec.rank, alpha=spec.alpha,
            data_position=data_position, accumulated_groups=0 if accumulated is None else accumulated.groups,
            accumulated_samples=0 if accumulated is None else accumulated.samples,
        )
        scheduler = a.schedule.state_dict()
        if accumulated is None:
            scheduler["samples_seen"] = scheduler["samples_at_last_step"]
        return state, scheduler

    def save_adapter(self, name: str, step: int, data_position: DataPosition | None = None,
                     accumulated: AccumulatedGrad | None = None) -> str:
        """Write `{save}/checkpoints/step_{step}` for the adapter; returns its path.

        `step` is the adapter's step as the registry counts it; this rank keeps none.
        `accumulated` is the adapter's part-window gradient summed over every rank (the
        train group gathers it with `accumulated_grad`); None: nothing toward the next step
        is kept.
        """
        a = self._loaded(name)
        spec = a.spec
        state, scheduler = self._checkpoint_state(name, step, data_position, accumulated)
        path = write_checkpoint(
            spec.save_dir, step,  # type: ignore[arg-type]
            write_adapter=lambda p: export_peft_adapter(self.model, spec.slot, p, rank=spec.rank, alpha=spec.alpha),
            optimizer=self.optimizer_state(name), scheduler=scheduler, trainer_state=state,
            accumulated_grad=accumulated,
        )
        return str(path)
