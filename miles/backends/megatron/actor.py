"""One rank (a DP replica's TP shard) of the Megatron training backend.

A megatron-core GPTModel shard with the slot page table in its parallel linears
(`miles.backends.megatron.lora`), one `SlotAdamW` over this rank's LoRA shards and one
LR schedule per adapter. The training contract is the torch backend's, and so is most
of the code: this class subclasses `TorchTrainActor` and replaces only what touches the
model or crosses ranks:

- the forward (Megatron's [S, B] layout, logits gathered over TP);
- slot loads, exports and checkpoints, which read and write whole HF-shaped tensors and
  gather them over the TP group (every rank of DP replica 0 takes part; global rank 0
  writes);
- the step: gradients summed over the DP group, then each stepping slot's norm taken
  over all TP shards (sharded tensors' squares summed over TP, replicated ones counted
  once), so clipping, AdamW (elementwise) and the result equal the torch backend's.

Driven in-process for one rank (TP = DP = 1):

    actor = MegatronTrainActor(MegatronActorConfig(hf_checkpoint="/tmp/tiny", n_slots=4, lora_rank=8))
    actor.init_distributed(None)           # a one-rank gloo group
    actor.load_adapter(spec); actor.train(samples, advantages, counts); actor.step_adapters(["math"])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.base import AdapterSpec, AdapterStepStats
from miles.lora.peft_io import _UNSUPPORTED, read_peft_dir, write_peft_dir
from miles.backends.megatron import lora as mlora
from miles.backends.megatron.model import (
    ModelShape,
    allow_recompute_in_eval,
    build_gpt_model,
    forward_logits,
    load_hf_weights,
    read_hf_state_dict,
    recompute_settings,
)
from miles.backends.torch.actor import DTYPES, LossSums, TorchTrainActor, TrainActorConfig, _Loaded
from miles.backends.torch.batching import MicroBatch, next_token_logprobs
from miles.backends.torch.checkpoint import AccumulatedGrad, OptimizerState, write_checkpoint
from miles.backends.torch.loss import entropy_from_logits
from miles.backends.torch.optimizer import SlotAdamW
from miles.utils.arguments import MilesConfig
from miles.utils.types import DataPosition, Sample


@dataclass(frozen=True)
class MegatronActorConfig(TrainActorConfig):
    """`TrainActorConfig` plus the tensor-parallel layout."""

    tensor_model_parallel_size: int = 1

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> MegatronActorConfig:
        base = TrainActorConfig.from_config(cfg)
        return cls(**{f: getattr(base, f) for f in base.__dataclass_fields__},
                   tensor_model_parallel_size=cfg.tensor_model_parallel_size)


class MegatronTrainActor(TorchTrainActor):
    """One Megatron rank: GPTModel shard + sharded slot page table + per-slot AdamW."""

    def __init__(self, config: MegatronActorConfig, rank: int = 0, world_size: int = 1) -> None:
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype!r}")
        tp = config.tensor_model_parallel_size
        if tp <= 0 or world_size % tp:
            raise ValueError(f"{world_size} ranks are not a multiple of --tensor-model-parallel-size {tp}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.device = torch.device(config.device)
        if self.device.type == "cpu" and config.num_threads:  # the CPUs Ray reserved for this rank
            torch.set_num_threads(config.num_threads)
        self.shape = ModelShape.from_hf_dir(config.hf_checkpoint)
        self.shape.check_tp(tp)
        self.adapters: dict[str, _Loaded] = {}
        self.model: Any = None
        # The rest of what `TorchTrainActor.__init__` sets (not called: it loads an HF model);
        # the model, page table and optimizer come in `init_process_group`.
        self._train_calls = 0
        self._undo = None
        self._activation_budget = None  # Megatron's micro-batches come from --micro-batch-size alone

    # ---- distributed set-up and the model ---------------------------------------------

    def init_process_group(self, address: str | None, timeout_s: float = 600.0) -> None:
        """Join the process group (a one-rank one when `address` is None), set up Megatron's
        TP/DP groups, then build this rank's model shard and optimizer."""
        from megatron.core import parallel_state

        if not dist.is_initialized():
            self._join_default_group(address or self.master_address(), timeout_s)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.config.tensor_model_parallel_size)
        if self.device.type == "cuda":
            from megatron.core import tensor_parallel

            # Attention forks the TP RNG tracker around dropout (0 here); on CUDA the fork
            # needs the tracker's states (on CPU `cpu_shims` makes the fork a no-op).
            tensor_parallel.model_parallel_cuda_manual_seed(self.config.seed)
        self._build_model()

    def _build_model(self) -> None:
        config = self.config
        recompute = recompute_settings(self.shape, config.recompute_granularity, config.recompute_method,
                                       config.recompute_num_layers, config.recompute_modules)
        model = build_gpt_model(self.shape, dtype=DTYPES[config.dtype], recompute=recompute)
        load_hf_weights(model, self.shape, read_hf_state_dict(config.hf_checkpoint))
        # LoRA weights and their AdamW moments stay fp32 over a bf16 base (as in the torch backend).
        self.parts = mlora.inject_parallel_lora(model, self.shape, n_slots=config.n_slots, max_rank=config.lora_rank,
                                                target_modules=config.target_modules)
        self.model = model.to(self.device).eval()
        allow_recompute_in_eval(self.model)
        self.param_names: list[str] = []
        self._param_parts: list[tuple[mlora.LoRAPart, str]] = []
        params: list[tuple[torch.nn.Parameter, int]] = []
        for name, part in self.parts.items():
            self.param_names += [f"{name}.lora_A", f"{name}.lora_B"]
            self._param_parts += [(part, "A"), (part, "B")]
            params += [(part.lora_A, 1), (part.lora_B, 2)]
        self.optimizer = SlotAdamW(params, n_slots=config.n_slots, betas=config.adam_betas, eps=config.adam_eps)
        self.target_short_names = sorted({n.rsplit(".", 1)[-1] for n in self.parts})

    def shutdown(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        super().shutdown()

    def _tp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    def _dp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    # ---- adapters in slots ----------------------------------------------------------------

    def _init_slot(self, spec: AdapterSpec, generator: torch.Generator) -> None:
        mlora.init_slot(self.parts, spec.slot, rank=spec.rank, alpha=spec.alpha, generator=generator)

    def _fresh_weights(self, spec: AdapterSpec, generator: torch.Generator) -> dict[str, tuple[Tensor, Tensor]]:
        return mlora.fresh_slot_weights(self.parts, rank=spec.rank, generator=generator)

    def _load_slot_weights(self, spec: AdapterSpec, path: Path) -> None:
        self.load_peft_dir(spec.slot, path)

    def load_peft_dir(self, slot: int, path: str | Path) -> tuple[int, float]:
        """Load a PEFT adapter directory (whole tensors) into `slot`; returns its (rank, alpha)."""
        tensors, config = read_peft_dir(path)
        rank, alpha = check_peft_config(config, Path(path), self.target_short_names)
        if rank > self.config.lora_rank:
            raise ValueError(f"{path}: adapter rank {rank} exceeds the slot width max_rank={self.config.lora_rank}; raise --lora-rank")
        mlora.set_slot_weights(self.parts, slot, tensors, rank=rank, alpha=alpha)
        return rank, alpha

    def _first_replica(self) -> bool:
        return self.dp_rank == 0

    def _pad_moments(self, tensors: dict[str, Tensor], spec: AdapterSpec, path: Path,
                     what: str = "optimizer state") -> list[Tensor]:
        """Whole rank-sliced moments or gradients (HF shapes) -> this rank's padded slot views."""
        out = []
        for name, (param, rank_dim), (part, which) in zip(self.param_names, self.optimizer.params, self._param_parts):
            if name not in tensors:
                raise ValueError(f"checkpoint {path} has no {what} for {name}: it was saved for another model")
            whole = tensors[name]
            expected = (spec.rank, part.in_features) if which == "A" else (part.out_features, spec.rank)
            if tuple(whole.shape) != expected:
                raise ValueError(f"checkpoint {path}: {what} {name} has shape {list(whole.shape)}, expected {list(expected)}")
            full = torch.zeros_like(param[spec.slot])
            full.narrow(rank_dim - 1, 0, spec.rank).copy_(part.shard_slot_view(which, whole))
            out.append(full)
        return out

    def cleanup_adapter(self, name: str) -> None:
        loaded = self._loaded(name)
        mlora.clear_slot(self.parts, loaded.spec.slot)
        self.optimizer.reset_slot(loaded.spec.slot)
        del self.adapters[name]

    # ---- training ---------------------------------------------------------------------------

    def train(self, samples: Sequence[Sample], advantages: Sequence[float],
              samples_per_adapter: dict[str, int]) -> dict[str, LossSums]:
        """Forward and backward of this replica's samples (every TP rank of a replica gets
        the same ones); only TP rank 0 reports loss sums, so a replica counts once."""
        stats = super().train(samples, advantages, samples_per_adapter)
        return stats if self.tp_rank == 0 else {}

    def _forward_logprobs(self, batch: MicroBatch, slots: list[int], *, entropy: bool = False) -> Any:
        """`TorchTrainActor._forward_logprobs` on the Megatron shard (logits gathered over TP)."""
        with mlora.use_slots(self.model, slots):
            logits = forward_logits(self.model, self.shape, batch.input_ids_BL)
        logprobs = next_token_logprobs(logits, batch.input_ids_BL)
        if not entropy:
            return logprobs
        return logprobs, entropy_from_logits(logits[:, :-1])  # position t predicts token t + 1

    def step_adapters(self, names: Sequence[str]) -> dict[str, AdapterStepStats]:
        """Optimizer step of the given adapters only; every rank calls it with the same names."""
        names = sorted(names)
        loaded = [self._loaded(name) for name in names]
        self._all_reduce_slot_grads([a.spec.slot for a in loaded])
        out = {}
        for a in loaded:
            slot = a.spec.slot
            self.optimizer.mask_slot_grad(slot)
            self.optimizer.scale_slot_grad(slot, 1.0 / a.spec.global_batch_size)
            grad_norm = self._clip_slot_grad(slot, self.config.clip_grad)
            lr = a.schedule.begin_step()
            self.optimizer.step_slot(slot, lr)
            self.optimizer.zero_slot_grad(slot)
            out[a.spec.name] = AdapterStepStats(grad_norm=grad_norm, lr=lr)
        return out

    def _all_reduce_slot_grads(self, slots: list[int]) -> None:
        """Sum the stepping slots' gradients over the DP replicas (same TP rank)."""
        if self.world_size == self.config.tensor_model_parallel_size or not slots:
            return
        grads = [g for slot in slots for g in self.optimizer.slot_grads(slot)]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._dp_group())
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def _clip_slot_grad(self, slot: int, max_norm: float) -> float:
        """`SlotAdamW.clip_slot_grad` with the norm taken over every TP shard: squares of
        sharded gradients summed over TP, replicated ones (equal on every rank) once."""
        grads = self.optimizer.slot_grads(slot)
        norms = torch.stack(torch._foreach_norm(grads, dtype=torch.float32))
        sharded = torch.tensor([part.sharded == which for part, which in self._param_parts], device=norms.device)
        sq = norms.square()
        sharded_sq = sq[sharded].sum()
        if self.config.tensor_model_parallel_size > 1:
            dist.all_reduce(sharded_sq, op=dist.ReduceOp.SUM, group=self._tp_group())
        norm = (sharded_sq + sq[~sharded].sum()).sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return float(norm)

    # ---- export and checkpoints (gathered over TP) ----------------------------------------------

    def export_adapter(self, name: str) -> dict[str, Tensor]:
        """The adapter's whole LoRA tensors in PEFT names (every rank of DP replica 0 must
        call: a TP gather); rank 0 returns them, the others an empty dict."""
        if self.dp_rank != 0:
            return {}
        tensors = mlora.gather_slot_weights(self.parts, self._loaded(name).spec.slot)
        return tensors if self.rank == 0 else {}

    def optimizer_state(self, name: str) -> OptimizerState:
        """The adapter's AdamW moments, whole and rank-sliced by LoRA parameter name (a TP gather)."""
        spec = self._loaded(name).spec
        exp_avg, exp_avg_sq, step = self.optimizer.slot_state(spec.slot)

        def whole(ts: list[Tensor]) -> dict[str, Tensor]:
            return {n: part.gather(which, t, spec.rank).cpu().contiguous()
                    for n, t, (part, which) in zip(self.param_names, ts, self._param_parts)}

        hyper = {"lr": spec.lr, "weight_decay": spec.weight_decay, "betas": list(self.optimizer.betas), "eps": self.optimizer.eps}
        return OptimizerState(exp_avg=whole(exp_avg), exp_avg_sq=whole(exp_avg_sq), step=step, hyper=hyper)

    def accumulated_grad(self, name: str) -> tuple[dict[str, Tensor], int]:
        """The adapter's gradient toward its next step, summed over the DP replicas and gathered
        over TP (every rank must call): whole and rank-sliced by LoRA parameter name on rank 0,
        none on the others; and the samples it covers (every rank's clock agrees)."""
        a = self._loaded(name)
        spec = a.spec
        samples = a.schedule.samples_seen - a.schedule.samples_at_last_step
        grads = [g.detach().clone() for g in self.optimizer.slot_grads(spec.slot)]
        if self.world_size > self.config.tensor_model_parallel_size:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._dp_group())
            grads = [chunk.view_as(g) for chunk, g in zip(torch.split(flat, [g.numel() for g in grads]), grads)]
        if self.dp_rank != 0:
            return {}, samples
        tensors = {n: part.gather(which, g, spec.rank).cpu().contiguous()
                   for n, g, (part, which) in zip(self.param_names, grads, self._param_parts)}
        return (tensors if self.rank == 0 else {}), samples

    def save_adapter(self, name: str, step: int, data_position: DataPosition | None = None,
                     accumulated: AccumulatedGrad | None = None) -> str:
        """Write `{save}/checkpoints/step_{step}` (every rank of DP replica 0 gathers; rank 0
        writes and returns the path, the others return ''). `accumulated`: the part-window
        gradient as `accumulated_grad` gathered it (None: nothing toward the next step kept)."""
        a = self._loaded(name)
        spec = a.spec
        state, scheduler = self._checkpoint_state(name, step, data_position, accumulated)
        if self.dp_rank != 0:
            return ""
        tensors = mlora.gather_slot_weights(self.parts, spec.slot)
        optimizer = self.optimizer_state(name)
        if self.rank != 0:
            return ""
        path = write_checkpoint(
            spec.save_dir, step, write_adapter=lambda p: write_peft_dir(p, tensors, self.peft_config(name)),  # type: ignore[arg-type]
            optimizer=optimizer, scheduler=scheduler, trainer_state=state, accumulated_grad=accumulated,
        )
        return str(path)


def check_peft_config(config: dict[str, Any], path: Path, targets: list[str]) -> tuple[int, float]:
    """(rank, alpha) of a PEFT `adapter_config.json` the Megatron page table can hold, with
    the same rules as `miles.lora.load_peft_adapter`."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type is {config.get('peft_type')!r}; only LORA adapters load into slots")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{path}: {what} is not supported by the slot page table; save the adapter without it")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={config.get('bias')!r} is not supported; train the adapter with bias='none'")
    wanted = config.get("target_modules")
    if isinstance(wanted, list):
        missing = {t for t in wanted if t.rsplit(".", 1)[-1] not in targets}
        if missing:
            raise ValueError(f"{path}: adapter targets {sorted(missing)} which are not LoRA layers of this model "
                             f"(targets: {targets}); widen --target-modules")
    if "r" not in config or "lora_alpha" not in config:
        raise ValueError(f"{path}: adapter_config.json lacks 'r' or 'lora_alpha'")
    return int(config["r"]), float(config["lora_alpha"])
