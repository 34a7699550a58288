"""The training of one rank, the same for every backend: `TrainCore` over a `TrainModel`.

It holds the loaded adapters (spec and LR schedule) and one `SlotAdamW` over the model's
LoRA rows, and does everything between a train rank's methods and the model: loads,
fresh or resumed from a checkpoint; train calls cut into micro-batches, each sample's
loss with its adapter's settings, and the take-back of a call that failed; the optimizer
step; the tensors and state a checkpoint is made of. No Ray, no process group of its own:

    core = TrainCore(config, TorchTrainModel(config), rank=0)
    core.load_adapter(AdapterSpec(name="math", slot=0, rank=8, alpha=16.0, global_batch_size=8))
    core.train(samples, advantages, samples_per_adapter={"math": 8})
    core.step_adapters(["math"])
    # client-driven adapters (Tinker): their datums train in the same micro-batches
    result = core.train_batch(samples, advantages, {"math": 8}, client=[work])   # result.client[0]: DatumOutputs
    core.step_adapters(["sft-1"], adam={"sft-1": AdamStep(learning_rate=1e-4)})

Every sample enters the gradient with weight 1 and a slot's gradients persist across
train calls until that adapter steps; at step time the stepping slots' gradients are
summed over the data-parallel replicas, scaled by `1 / adapter_global_batch_size`, clipped
by the slot's own norm and applied to that slot only. A rank counts no adapter steps (the
registry owns them; a save is named by the step it is given); only AdamW's bias-correction
count and the LR schedule's sample clock live here.

A client-driven adapter's datums (`ClientWork`) enter with their own Tinker loss (a token
sum, `client_loss`) and its step takes the settings of its `AdamStep`: that lr, betas, eps,
weight decay and clip norm, the gradient unscaled, no LR schedule.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles.backends.base import AdapterSpec, AdapterStepStats, LoadResult
from miles.backends.common.batching import (
    ActivationBudget,
    Advantage,
    MicroBatch,
    make_micro_batches,
    response_logprobs,
)
from miles.backends.common.checkpoint import (
    AccumulatedGrad,
    Checkpoint,
    OptimizerState,
    TrainerState,
    checkpoint_step,
    read_checkpoint,
    read_pending_grad,
    write_checkpoint,
    write_checkpoint_dir,
)
from miles.backends.common.client_loss import ClientRow, client_loss_terms, client_rows, datum_outputs
from miles.backends.common.loss import LossParams, approx_kl_per_sample, policy_loss_terms
from miles.backends.common.lr_schedule import LRSchedule
from miles.backends.common.optimizer import SlotAdamW, SlotStep
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.model import TrainModel
from miles.lora import peft_adapter_config, peft_tensors, write_peft_dir
from miles.lora.slots import PEFT_PREFIX
from miles.utils.loss_settings import LossSettings
from miles.utils.types import DataPosition, Sample
from miles.utils.types.client import AdamStep, ClientWork, DatumOutput
from miles.utils.types.client_commands import LoraGroup

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class RankTrainResult:
    """What one rank's train call gave."""

    stats: dict[str, LossSums]
    """Loss sums of the server-driven adapters (empty on a rank that does not report)."""
    client: list[list[DatumOutput]] | None = None
    """One list per `ClientWork` given (this rank's datums of it, in order); None on a rank
    that does not report (Megatron: TP ranks past 0)."""


@dataclass(frozen=True)
class GradShare:
    """A rank's part of an adapter's gradient toward its next step (`TrainCore.accumulated_grad`)."""

    tensors: dict[str, Tensor]
    """By LoRA parameter name, whole, rank-sliced, CPU, not scaled: a torch rank's own share
    (the train group sums them); Megatron: the replicas' sum on global rank 0, none elsewhere."""
    samples: int
    """The samples of all ranks trained toward that step (the LR clock's count, the same on every rank)."""


def sum_grad_shares(shares: Sequence[GradShare]) -> dict[str, Tensor]:
    """The whole gradient from the ranks' shares (a Megatron rank past 0 holds none)."""
    tensors: dict[str, Tensor] = {}
    for share in shares:
        for key, value in share.tensors.items():
            tensors[key] = tensors[key] + value if key in tensors else value
    return tensors


@dataclass
class LoadedAdapter:
    """An adapter in its slot: its spec and its LR schedule (whose clock counts its samples)."""

    spec: AdapterSpec
    schedule: LRSchedule
    adam: AdamStep | None = None
    """The settings of its latest client `optim_step` (a checkpoint records them); None: none yet."""


@dataclass
class _BatchUndo:
    """What the latest train call changed, so it can be taken back until a step."""

    grads: dict[int, list[Tensor] | None]
    """Slot -> copies of its gradients before the call; None when they were all zero
    (the first call after a step: no copy is held, the undo zeroes them)."""
    samples_seen: dict[str, int]
    """Adapter -> its LR clock before the call."""


def _add_stats(stats: dict[str, LossSums], adapters: Sequence[str], out: Any) -> None:
    """Add each sample's policy-loss terms (`policy_loss_terms`' output, row i of adapter
    `adapters[i]`) to its adapter's sums."""
    clipped_B = out.pg_clipfrac_B * out.tokens_B
    rows = zip(adapters, out.loss_B.tolist(), clipped_B.tolist(), out.tokens_B.tolist(),
               out.kl_loss_B.tolist(), out.tis_B.tolist())
    for adapter, loss, clipped, tokens, kl, tis in rows:
        s = stats.setdefault(adapter, LossSums())
        s.loss_sum += loss
        s.samples += 1
        s.clipped_tokens += clipped
        s.tokens += tokens
        s.kl_sum += kl
        s.tis_sum += tis


def _slot_step(spec: AdapterSpec, lr: float, adam: AdamStep | None) -> SlotStep:
    """An adapter's part of a fused step: its schedule's lr and batch scale, or its `AdamStep`."""
    if adam is None:
        return SlotStep(slot=spec.slot, lr=lr, grad_scale=1.0 / spec.global_batch_size)
    return SlotStep(slot=spec.slot, lr=adam.learning_rate, grad_scale=1.0, betas=(adam.beta1, adam.beta2),
                    eps=adam.eps, weight_decay=adam.weight_decay, max_norm=adam.grad_clip_norm)


def adapter_seed(seed: int, name: str) -> int:
    """Seed of an adapter's fresh init: the same on every rank and in every run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TrainCore:
    """One rank's training over a `TrainModel`: adapters, loads, micro-batches, loss, take-back, step, checkpoints."""

    def __init__(self, config: TrainActorConfig, model: TrainModel, rank: int = 0,
                 activation_budget: ActivationBudget | None = None) -> None:
        self.config = config
        self.model = model
        self.rank = rank
        self.device = torch.device(config.device)
        self.optimizer = SlotAdamW(model.lora_params, n_slots=config.n_slots, betas=config.adam_betas,
                                   eps=config.adam_eps)
        self.adapters: dict[str, LoadedAdapter] = {}
        self.activation_budget = activation_budget
        """Where no micro-batch size is given, micro-batches sized by estimated activation
        memory (the torch backend on CPU); None: the whole batch."""
        self._undo: _BatchUndo | None = None

    # ---- adapters in slots ----------------------------------------------------------

    def load_adapter(self, spec: AdapterSpec, checkpoint: str | None = None,
                     miles_checkpoint: str | None = None) -> LoadResult:
        """Put an adapter into its slot, fresh (A seeded by seed and name, B zero), resumed
        from a checkpoint directory of ours, or started from the LoRA weights of a Miles
        checkpoint (`miles_checkpoint`: a fresh optimizer and LR clock, at its step); says
        which step and data position it resumed at."""
        self._check_free(spec)
        self.optimizer.reset_slot(spec.slot)
        schedule = self._new_schedule(spec)
        result = LoadResult()
        if checkpoint is not None:
            result, schedule = self._resume(spec, Path(checkpoint), schedule)
        elif miles_checkpoint is not None:
            result = self._start_from_miles(spec, Path(miles_checkpoint))
        else:
            self.model.init_slot(spec.slot, rank=spec.rank, alpha=spec.alpha, generator=self._generator(spec))
        self._configure_slot(spec)
        if spec.num_step is not None:
            # `num_step` counts from the step this registration started at.
            schedule.total_steps = spec.final_step(result.step)
        self.adapters[spec.name] = LoadedAdapter(spec=spec, schedule=schedule)
        return result

    def fresh_export(self, spec: AdapterSpec) -> dict[str, Tensor]:
        """What `export_adapter` will give once `load_adapter(spec)` has put the fresh adapter
        in its slot (the same seeded draws), computed without touching the model."""
        self.check_rank(spec)
        return self._trained_tensors(spec, peft_tensors(self.model.fresh_weights(rank=spec.rank,
                                                                                 generator=self._generator(spec))))

    def _configure_slot(self, spec: AdapterSpec) -> None:
        """The slot's optimizer settings, and its frozen layers (`spec.frozen`) made exactly the
        base model's: their B and moments zeroed (a fresh B is zero already; a checkpoint of the
        same layout holds zeros) and their rows never stepped."""
        frozen = [i for i, name in enumerate(self.model.param_names)
                  if self._frozen_module(spec, name.rsplit(".", 1)[0])]
        with torch.no_grad():
            for i in frozen:
                if self.model.param_names[i].endswith(".lora_B"):
                    self.model.lora_params[i][0][spec.slot].zero_()
        self.optimizer.configure_slot(spec.slot, rank=spec.rank, lr=spec.lr, weight_decay=spec.weight_decay,
                                      frozen=frozen)

    @staticmethod
    def _frozen_module(spec: AdapterSpec, module: str) -> bool:
        return bool(spec.frozen) and LoraGroup.of(module) in spec.frozen

    def _trained_tensors(self, spec: AdapterSpec, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """`tensors` (PEFT names) without the layers the adapter freezes: what it exports and
        saves (a loader gives the layers it lacks a zero delta, which they have)."""
        if not spec.frozen:
            return tensors
        return {key: t for key, t in tensors.items()
                if not self._frozen_module(spec, key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0])}

    def _generator(self, spec: AdapterSpec) -> torch.Generator:
        if spec.seed is not None:  # a client's seed: the same init whatever the model is called
            return torch.Generator().manual_seed(spec.seed)
        return torch.Generator().manual_seed(adapter_seed(self.config.seed, spec.name))

    def _check_free(self, spec: AdapterSpec) -> None:
        if spec.name in self.adapters:
            raise ValueError(f"adapter '{spec.name}' is already loaded in slot {self.adapters[spec.name].spec.slot}")
        for other in self.adapters.values():
            if other.spec.slot == spec.slot:
                raise ValueError(f"slot {spec.slot} is held by adapter '{other.spec.name}': clean it up first")
        self.check_rank(spec)

    def check_rank(self, spec: AdapterSpec) -> None:
        if not 0 < spec.rank <= self.config.lora_rank:
            raise ValueError(f"adapter '{spec.name}' has rank {spec.rank}; "
                             f"it must be in 1..{self.config.lora_rank} (--lora-rank)")

    def _new_schedule(self, spec: AdapterSpec) -> LRSchedule:
        return LRSchedule(
            lr=spec.lr, samples_per_step=spec.global_batch_size, style=spec.lr_decay_style,  # type: ignore[arg-type]
            warmup_steps=spec.lr_warmup_steps, warmup_init=min(self.config.lr_warmup_init, spec.lr),
            min_lr=self.config.min_lr,
        )

    def _start_from_miles(self, spec: AdapterSpec, path: Path) -> LoadResult:
        """A Miles checkpoint's PEFT weights into the slot (its shards and optimizer are not read)."""
        config = json.loads((path / "adapter_config.json").read_text())
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if rank != spec.rank or alpha is None or abs(float(alpha) - spec.alpha) > 1e-6:
            raise ValueError(f"Miles checkpoint {path} holds a rank-{rank} alpha-{alpha} adapter but adapter "
                             f"'{spec.name}' is configured with rank {spec.rank} alpha {spec.alpha}: use the "
                             "checkpoint's rank and alpha, or give the adapter a fresh save directory")
        self.model.init_slot(spec.slot, rank=spec.rank, alpha=spec.alpha, generator=self._generator(spec))
        self.model.load_peft_dir(spec.slot, path)
        return LoadResult(checkpoint=path, step=checkpoint_step(path), miles_checkpoint=True)

    def _resume(self, spec: AdapterSpec, path: Path, fresh: LRSchedule) -> tuple[LoadResult, LRSchedule]:
        ckpt = read_checkpoint(path)
        if ckpt.trainer_state.rank != spec.rank or abs(ckpt.trainer_state.alpha - spec.alpha) > 1e-6:
            raise ValueError(
                f"checkpoint {path} holds a rank-{ckpt.trainer_state.rank} alpha-{ckpt.trainer_state.alpha} adapter "
                f"but adapter '{spec.name}' is configured with rank {spec.rank} alpha {spec.alpha}: "
                "use the checkpoint's rank and alpha, or give the adapter a fresh save directory"
            )
        self.model.load_peft_dir(spec.slot, path)
        exp_avg = self.model.pad_slot_tensors(ckpt.optimizer.exp_avg, spec.slot, spec.rank, path, "optimizer state")
        exp_avg_sq = self.model.pad_slot_tensors(ckpt.optimizer.exp_avg_sq, spec.slot, spec.rank, path,
                                                 "optimizer state")
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
        if self.model.dp_rank == 0:
            grads = self.model.pad_slot_tensors(acc.tensors, spec.slot, spec.rank, ckpt.path, "accumulated gradient")
            torch._foreach_copy_(self.optimizer.slot_grads(spec.slot), grads)
        return acc.groups

    def cleanup_adapter(self, name: str) -> None:
        """Empty the adapter's slot: weights, moments, step counter, retained grads, schedule."""
        loaded = self.loaded(name)
        self.model.clear_slot(loaded.spec.slot)
        self.optimizer.reset_slot(loaded.spec.slot)
        del self.adapters[name]
        self._undo = None

    def loaded_adapters(self) -> dict[str, int]:
        return {name: a.spec.slot for name, a in self.adapters.items()}

    def loaded(self, name: str) -> LoadedAdapter:
        if name not in self.adapters:
            raise KeyError(f"adapter '{name}' is not loaded on train rank {self.rank}: reconcile adapters first")
        return self.adapters[name]

    def loss_settings(self, adapter: str) -> LossSettings:
        return self.loaded(adapter).spec.loss or self.config.loss

    # ---- training -------------------------------------------------------------------

    def train(
        self, samples: Sequence[Sample], advantages: Sequence[Advantage], samples_per_adapter: dict[str, int]
    ) -> dict[str, LossSums]:
        """`train_batch` of server-driven samples alone; its loss sums."""
        return self.train_batch(samples, advantages, samples_per_adapter).stats

    def train_batch(
        self, samples: Sequence[Sample], advantages: Sequence[Advantage], samples_per_adapter: dict[str, int],
        client: Sequence[ClientWork] = (),
    ) -> RankTrainResult:
        """Forward and backward this rank's samples and client datums (gradients accumulate
        per slot); the loss sums and datum outputs of the rank that reports for its replica,
        none from the others.

        `advantages[i]` is sample i's advantage: one value, or one per response token
        (the reinforce++ estimators).

        `samples_per_adapter` counts each adapter's samples in the whole (all-rank)
        batch; it advances the adapters' LR clocks identically on every rank.

        `client` datums with a backward train in the samples' micro-batches, with their
        work's Tinker loss; those of a `forward` (`backward=False`) run without grad and
        touch no slot. A call that fails takes back every gradient it added, client ones too.
        """
        for sample in samples:
            loaded = self.loaded(sample.adapter)
            if sample.slot != loaded.spec.slot:
                raise ValueError(f"sample of adapter '{sample.adapter}' names slot {sample.slot}, "
                                 f"but the adapter is in slot {loaded.spec.slot}")
        for name in samples_per_adapter:
            self.loaded(name)
        rows = self._client_rows(client)
        trained = [r for r in rows if r.backward]
        stats: dict[str, LossSums] = {}
        outputs: dict[tuple[int, int], DatumOutput] = {}
        need_rollout = any(self.loss_settings(name).needs_rollout_logprobs for name in {s.adapter for s in samples})
        batches = self.micro_batches(samples, advantages, need_rollout_logprobs=need_rollout,
                                     max_tokens=self.budget_tokens(samples, trained), client=trained)
        scored = [r for r in rows if not r.backward]
        forwards = self.micro_batches([], [], max_tokens=self.budget_tokens([], scored), client=scored)
        self._remember_batch({s.adapter for s in samples} | set(samples_per_adapter) | {r.adapter for r in trained})
        try:
            for batch in batches:
                if batch.client is None:
                    self.train_micro_batch(batch.to(self.device), stats)
                else:
                    self.train_mixed_micro_batch(batch.to(self.device), stats, outputs)
            for batch in forwards:
                self.forward_client(batch.to(self.device), outputs)
            for name, n in samples_per_adapter.items():
                self.adapters[name].schedule.add_samples(n)
        except BaseException:
            self.discard_batch()
            raise
        if not self.model.reports_loss:
            return RankTrainResult(stats={})
        by_work = [[outputs[(w, d)] for d in range(len(work.datums))] for w, work in enumerate(client)]
        return RankTrainResult(stats=stats, client=by_work)

    def _client_rows(self, client: Sequence[ClientWork]) -> list[ClientRow]:
        """The client datums as validated rows; every work's adapter loaded in its slot."""
        for work in client:
            loaded = self.loaded(work.adapter)
            if work.slot != loaded.spec.slot:
                raise ValueError(f"client work of adapter '{work.adapter}' names slot {work.slot}, "
                                 f"but the adapter is in slot {loaded.spec.slot}")
        return client_rows(client, self.model.vocab_size)

    def micro_batches(self, samples: Sequence[Sample], advantages: Sequence[Advantage], *,
                      need_rollout_logprobs: bool = False, max_tokens: int | None = None,
                      client: Sequence[ClientRow] = ()) -> list[MicroBatch]:
        return make_micro_batches(samples, advantages, self.config.micro_batch_size,
                                  max_tokens=self.config.max_tokens_per_micro_batch or max_tokens,
                                  need_rollout_logprobs=need_rollout_logprobs, client=client)

    def budget_tokens(self, samples: Sequence[Sample], client: Sequence[ClientRow] = ()) -> int | None:
        """Tokens per training micro-batch under the activation budget, where no micro-batch
        size was given; None: the whole batch."""
        budget = self.activation_budget
        if budget is None or self.config.micro_batch_size or self.config.max_tokens_per_micro_batch:
            return None
        tokens = budget.max_tokens(samples, [r.length for r in client])
        if tokens is not None and not budget.announced:
            budget.announced = True
            logger.info(
                "Training in micro-batches of up to %d tokens: about %.0f KiB a token stays for the backward, "
                "and --activation-budget-mb is %g (--micro-batch-size sets the split instead)",
                tokens, budget.bytes_per_token / 1024, budget.budget_bytes / 2**20)
        return tokens

    def train_micro_batch(self, batch: MicroBatch, stats: dict[str, LossSums]) -> None:
        """Forward and backward of one micro-batch, each sample's loss with its adapter's
        settings (`LossParams`), so a mixed batch gives every adapter the gradient it would
        get alone; adds to each adapter's `stats`."""
        settings = [self.loss_settings(name) for name in batch.adapters]
        params = LossParams.gather(settings, list(range(len(settings)))).to(self.device)
        ref = None
        if any(s.use_kl_loss for s in settings):
            with torch.no_grad():
                ref = self.model.forward_logprobs(batch, [-1] * len(batch.slots))
        entropy = None
        if any(s.entropy_coef != 0 for s in settings):
            logprobs, entropy = self.model.forward_logprobs(batch, batch.slots, entropy=True)
        else:
            logprobs = self.model.forward_logprobs(batch, batch.slots)
        rollout = batch.rollout_logprobs_BT if any(s.needs_rollout_logprobs for s in settings) else None
        out = policy_loss_terms(
            logprobs, logprobs.detach(), batch.advantages_BT, batch.loss_mask_BT, params,
            rollout_logprobs_BT=rollout, ref_logprobs_BT=ref, entropy_BT=entropy, tis_args=self.config,
        )
        out.loss_B.sum().backward()
        _add_stats(stats, batch.adapters, out)

    def train_mixed_micro_batch(self, batch: MicroBatch, stats: dict[str, LossSums],
                                outputs: dict[tuple[int, int], DatumOutput]) -> None:
        """`train_micro_batch` of a micro-batch with client rows: one forward scoring every
        row's targets, the samples' policy loss on rows ..n and each datum's Tinker loss after
        them, one backward; puts each datum's output in `outputs` by (work, datum)."""
        assert batch.client is not None
        n, part = batch.n_samples, batch.client
        targets_BL = batch.target_tokens_BL()
        settings = [self.loss_settings(name) for name in batch.adapters[:n]]
        ref = None
        if any(s.use_kl_loss for s in settings):
            with torch.no_grad():
                ref = self.model.forward_logprobs(batch, [-1] * len(batch.slots), targets_BL=targets_BL)[:n, :-1]
        entropy = None
        if any(s.entropy_coef != 0 for s in settings):
            logprobs_BL, entropy_BL = self.model.forward_logprobs(batch, batch.slots, entropy=True,
                                                                  targets_BL=targets_BL)
            entropy = entropy_BL[:n, :-1]
        else:
            logprobs_BL = self.model.forward_logprobs(batch, batch.slots, targets_BL=targets_BL)
        terms = client_loss_terms(logprobs_BL[part.start :], part.inputs)
        total = terms.loss_C.sum()
        if n:
            params = LossParams.gather(settings, list(range(n))).to(self.device)
            logprobs = logprobs_BL[:n, :-1]
            rollout = batch.rollout_logprobs_BT[:n] if any(s.needs_rollout_logprobs for s in settings) else None
            out = policy_loss_terms(
                logprobs, logprobs.detach(), batch.advantages_BT[:n], batch.loss_mask_BT[:n], params,
                rollout_logprobs_BT=rollout, ref_logprobs_BT=ref, entropy_BT=entropy, tis_args=self.config,
            )
            total = total + out.loss_B.sum()
            _add_stats(stats, batch.adapters[:n], out)
        total.backward()
        for row, output in zip(part.rows, datum_outputs(part.rows, logprobs_BL[part.start :], terms)):
            outputs[(row.work, row.datum)] = output

    @torch.no_grad()
    def forward_client(self, batch: MicroBatch, outputs: dict[tuple[int, int], DatumOutput]) -> None:
        """A micro-batch of client rows only, without grad (`forward`): their logprobs and losses."""
        assert batch.client is not None and batch.n_samples == 0
        logprobs_CL = self.model.forward_logprobs(batch, batch.slots, targets_BL=batch.target_tokens_BL())
        terms = client_loss_terms(logprobs_CL, batch.client.inputs)
        for row, output in zip(batch.client.rows, datum_outputs(batch.client.rows, logprobs_CL, terms)):
            outputs[(row.work, row.datum)] = output

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

    def step_adapters(self, names: Sequence[str],
                      adam: dict[str, AdamStep] | None = None) -> dict[str, AdapterStepStats]:
        """Optimizer step of the given adapters only; every rank must call it with the same names.

        A server-driven adapter steps with its LR schedule, its gradient scaled by
        `1 / global_batch_size` and clipped by `--clip-grad`; one given an `AdamStep` in
        `adam` (a client's `optim_step`) with that step's lr, betas, eps, weight decay and
        clip norm (0: none), its gradient unscaled (Tinker's losses are sums), and no schedule.
        """
        adam = adam or {}
        unknown = sorted(set(adam) - set(names))
        if unknown:
            raise ValueError(f"Adam settings given for {unknown}, "
                             f"which are not among the adapters to step {sorted(names)}")
        loaded = [self.loaded(name) for name in sorted(names)]
        self._undo = None  # a batch that stepped is kept
        slots = [a.spec.slot for a in loaded]
        if slots:
            self.model.reduce_grads([g for slot in slots for g in self.optimizer.slot_grads(slot)])
        lrs = {a.spec.name: adam[a.spec.name].learning_rate if a.spec.name in adam else a.schedule.begin_step()
               for a in loaded}
        norms = self.optimizer.step_slots(
            [_slot_step(a.spec, lrs[a.spec.name], adam.get(a.spec.name)) for a in loaded],
            max_norm=self.config.clip_grad, slot_norm=self.model.slot_grad_norm,
        )
        for a in loaded:
            a.adam = adam.get(a.spec.name, a.adam)
        return {a.spec.name: AdapterStepStats(grad_norm=norms[a.spec.slot], lr=lrs[a.spec.name]) for a in loaded}

    @torch.no_grad()
    def reward_kl(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Each sample's per-response-token KL of its adapter's policy to the base model
        (slot off), with its adapter's `--kl-loss-type`: the KL that `--kl-coef` subtracts
        from the reinforce++ token rewards. As in Miles the policy's logprobs are the
        engine's with `--use-rollout-logprobs`, else the trainer's before this step's update."""
        out: list[list[float]] = [[] for _ in samples]
        settings_by_adapter = {s.adapter: self.loss_settings(s.adapter) for s in samples}
        need_rollout = any(s.use_rollout_logprobs for s in settings_by_adapter.values())
        for batch in self.micro_batches(samples, [0.0] * len(samples), need_rollout_logprobs=need_rollout):
            batch = batch.to(self.device)
            settings = [settings_by_adapter[name] for name in batch.adapters]
            params = LossParams.gather(settings, list(range(len(settings)))).to(self.device)
            policy = self.model.forward_logprobs(batch, batch.slots).float()
            policy = torch.where(params.use_rollout_logprobs_B.view(-1, 1), batch.rollout_logprobs_BT, policy)
            base = self.model.forward_logprobs(batch, [-1] * len(batch.slots)).float()
            kl = approx_kl_per_sample(policy, base, params.kl_type_B)
            for index, values in zip(batch.indices, response_logprobs(kl, batch)):
                out[index] = values
        return out

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Each sample's response-token logprobs under its slot (in the given order)."""
        out: list[list[float]] = [[] for _ in samples]
        for batch in self.micro_batches(samples, [0.0] * len(samples)):
            batch = batch.to(self.device)
            logprobs_BT = self.model.forward_logprobs(batch, batch.slots)
            for index, values in zip(batch.indices, response_logprobs(logprobs_BT, batch)):
                out[index] = values
        return out

    # ---- export and checkpoints -----------------------------------------------------------

    def export_adapter(self, name: str) -> dict[str, Tensor]:
        """The adapter's LoRA tensors in PEFT names, sliced to its rank (CPU), the layers it
        freezes left out; every rank that `gathers` must call, and only a rank that `writes`
        gets them."""
        spec = self.loaded(name).spec
        return self._trained_tensors(spec, self.model.export_slot(spec.slot))

    def peft_config(self, spec: AdapterSpec) -> dict[str, Any]:
        """`adapter_config.json` of the adapter `spec` describes (its target modules: the
        layers it trains)."""
        targets = self.model.target_modules
        if spec.frozen:
            modules = {name.rsplit(".", 1)[0] for name in self.model.param_names}
            targets = sorted({m.rsplit(".", 1)[-1] for m in modules if not self._frozen_module(spec, m)})
        return peft_adapter_config(
            rank=spec.rank, alpha=spec.alpha, target_modules=targets,
            base_model_name_or_path=self.config.hf_checkpoint,
        )

    def optimizer_state(self, name: str) -> OptimizerState:
        """The adapter's AdamW moments (whole, rank-sliced, by LoRA parameter name) and step count."""
        spec = self.loaded(name).spec
        exp_avg, exp_avg_sq, step = self.optimizer.slot_state(spec.slot)
        adam = self.loaded(name).adam
        hyper = {"lr": spec.lr, "weight_decay": spec.weight_decay, "betas": list(self.optimizer.betas),
                 "eps": self.optimizer.eps} if adam is None else \
            {"lr": adam.learning_rate, "weight_decay": adam.weight_decay, "betas": [adam.beta1, adam.beta2],
             "eps": adam.eps, "grad_clip_norm": adam.grad_clip_norm}
        return OptimizerState(exp_avg=self.model.whole_tensors(exp_avg, spec.rank),
                              exp_avg_sq=self.model.whole_tensors(exp_avg_sq, spec.rank), step=step, hyper=hyper)

    def schedule_state(self, name: str) -> dict[str, Any]:
        return self.loaded(name).schedule.state_dict()

    def accumulated_grad(self, name: str) -> GradShare:
        """This rank's part of the adapter's gradient toward its next step (`TrainModel.gather_grad`)
        and the samples of all ranks trained toward that step."""
        a = self.loaded(name)
        tensors = self.model.gather_grad(self.optimizer.slot_grads(a.spec.slot), a.spec.rank)
        return GradShare(tensors, a.schedule.samples_seen - a.schedule.samples_at_last_step)

    def save_adapter(self, name: str, step: int, data_position: DataPosition | None = None,
                     accumulated: AccumulatedGrad | None = None) -> str:
        """Write `{save}/checkpoints/step_{step}` for the adapter; returns its path, or '' on
        a rank that only takes part in the gathers (or in none).

        `step` is the adapter's step as the registry counts it; this rank keeps none.
        `accumulated` is the adapter's part-window gradient summed over every rank (the
        train group gathers it with `accumulated_grad`); None: nothing toward the next step
        is kept.
        """
        spec = self.loaded(name).spec
        state, scheduler = self._checkpoint_state(name, step, data_position, accumulated)
        if not self.model.gathers:
            return ""
        tensors = self._trained_tensors(spec, self.model.export_slot(spec.slot))
        optimizer = self.optimizer_state(name)
        if not self.model.writes:
            return ""
        path = write_checkpoint(
            spec.save_dir, step,  # type: ignore[arg-type]
            write_adapter=lambda p: write_peft_dir(p, tensors, self.peft_config(spec)),
            optimizer=optimizer, scheduler=scheduler, trainer_state=state, accumulated_grad=accumulated,
        )
        return str(path)

    def save_client_state(self, name: str, directory: str, pending: dict[str, Tensor] | None = None) -> str:
        """A client's `save_state`: weights and optimizer state written to `directory` (the
        trainer state records the adapter's optimizer step count); '' on a rank that does not
        write. Every rank that `gathers` must call. `pending`: a page-out, which also writes the
        gradient of the calls not yet stepped (summed over every rank: `accumulated_grad`)."""
        a = self.loaded(name)
        spec = a.spec
        if not self.model.gathers:
            return ""
        tensors = self._trained_tensors(spec, self.model.export_slot(spec.slot))
        optimizer = self.optimizer_state(name)
        if not self.model.writes:
            return ""
        state = TrainerState(name=name, step=optimizer.step, registration_id=spec.registration_id, rank=spec.rank,
                             alpha=spec.alpha)
        path = write_checkpoint_dir(
            directory, write_adapter=lambda p: write_peft_dir(p, tensors, self.peft_config(spec)),
            optimizer=optimizer, scheduler=a.schedule.state_dict(), trainer_state=state, pending_grad=pending)
        return str(path)

    def load_client_state(self, name: str, directory: str, optimizer: bool = True) -> None:
        """A client's `load_state`: the checkpoint's weights into the adapter's slot, and its
        moments and step count when `optimizer` (else fresh ones); the pending gradient is
        dropped, unless the checkpoint is a page-out's: then its pending gradient and LR clock
        come back too, so the model goes on exactly where it left its slot. ValueError when it
        holds another rank or alpha than the adapter's."""
        spec = self.loaded(name).spec
        path = Path(directory)
        ckpt = read_checkpoint(path)
        if ckpt.trainer_state.rank != spec.rank or abs(ckpt.trainer_state.alpha - spec.alpha) > 1e-6:
            raise ValueError(f"checkpoint {path} holds a rank-{ckpt.trainer_state.rank} alpha-"
                             f"{ckpt.trainer_state.alpha} adapter but model '{name}' has rank {spec.rank} alpha "
                             f"{spec.alpha}: load it into a model created with the same rank")
        self.model.load_peft_dir(spec.slot, path)
        self.optimizer.reset_slot(spec.slot)  # moments, step count and pending gradient
        if optimizer:
            exp_avg = self.model.pad_slot_tensors(ckpt.optimizer.exp_avg, spec.slot, spec.rank, path,
                                                  "optimizer state")
            exp_avg_sq = self.model.pad_slot_tensors(ckpt.optimizer.exp_avg_sq, spec.slot, spec.rank, path,
                                                     "optimizer state")
            self.optimizer.load_slot_state(spec.slot, exp_avg, exp_avg_sq, ckpt.optimizer.step)
            pending = read_pending_grad(path)
            if pending is not None:
                self._restore_pending(name, path, pending, ckpt.scheduler)
        self._configure_slot(spec)  # after the loads: a frozen layer stays the base's whatever they held
        self._undo = None

    def _restore_pending(self, name: str, path: Path, pending: dict[str, Tensor], scheduler: dict[str, Any]) -> None:
        """A page-out's gradient back into the slot (the first DP replica holds the whole sum, the
        others zeros, as `_restore_accumulated_grad`) and its LR clock."""
        a = self.loaded(name)
        if self.model.dp_rank == 0:
            grads = self.model.pad_slot_tensors(pending, a.spec.slot, a.spec.rank, path, "pending gradient")
            torch._foreach_copy_(self.optimizer.slot_grads(a.spec.slot), grads)
        saved = LRSchedule.from_state_dict(scheduler)
        a.schedule = replace(a.schedule, samples_seen=saved.samples_seen,
                             samples_at_last_step=saved.samples_at_last_step)

    def _checkpoint_state(self, name: str, step: int, data_position: DataPosition | None,
                          accumulated: AccumulatedGrad | None) -> tuple[TrainerState, dict[str, Any]]:
        """`trainer_state.json` and `scheduler.json` of a save. Without a gradient the saved
        clock drops the samples trained since the last step, as the resumed window will."""
        a = self.loaded(name)
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
