"""The Megatron backend's `TrainModel`: one TP shard of a GPTModel with the slot page table
in its parallel linears (`miles.backends.megatron.lora`).

What differs from the torch backend's model is what touches the shards or crosses ranks:

- the forward (Megatron's [S, B] layout, logits gathered over TP);
- slot loads, exports and checkpoint tensors, which read and write whole HF-shaped
  tensors and gather them over the TP group (every rank of DP replica 0 takes part;
  global rank 0 holds the result and writes);
- gradients summed over the DP group only, and each slot's norm taken over all TP shards
  (sharded tensors' squares summed over TP, replicated ones counted once), so clipping,
  AdamW (elementwise) and the result equal the torch backend's.

Built once megatron-core's TP/DP groups exist (`MegatronTrainActor.init_process_group`):

    model = MegatronTrainModel(config, rank=0)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.common.batching import MicroBatch, next_token_logprobs, target_logprobs
from miles.backends.common.loss import entropy_from_logits
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
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.model import all_reduce_sum
from miles.lora.peft_io import check_peft_config, read_peft_dir


class MegatronTrainModel:
    """This rank's GPTModel shard with the sharded slot page table, in megatron-core's TP and DP groups."""

    def __init__(self, config: TrainActorConfig, shape: ModelShape, rank: int = 0, tp_size: int = 1) -> None:
        self.rank, self.tp_size = rank, tp_size
        recompute = recompute_settings(shape, config.recompute_granularity, config.recompute_method,
                                       config.recompute_num_layers, config.recompute_modules)
        module = build_gpt_model(shape, dtype=config.torch_dtype, recompute=recompute)
        load_hf_weights(module, shape, read_hf_state_dict(config.hf_checkpoint))
        # LoRA weights and their AdamW moments stay fp32 over a bf16 base (as in the torch backend).
        self.parts = mlora.inject_parallel_lora(module, shape, n_slots=config.n_slots, max_rank=config.lora_rank,
                                                target_modules=config.target_modules)
        """The LoRA parts by HF module name (`mlora.set_slot_weights(model.parts, ...)`)."""
        self.module = module.to(torch.device(config.device)).eval()
        """The GPTModel shard (`forward_logits(model.module, model.shape, ids)`)."""
        allow_recompute_in_eval(self.module)
        self.shape = shape
        self.param_names: list[str] = []
        self.lora_params: list[tuple[torch.nn.Parameter, int]] = []
        self._param_parts: list[tuple[mlora.LoRAPart, str]] = []
        for name, part in self.parts.items():
            self.param_names += [f"{name}.lora_A", f"{name}.lora_B"]
            self.lora_params += [(part.lora_A, 1), (part.lora_B, 2)]
            self._param_parts += [(part, "A"), (part, "B")]
        self.target_modules = sorted({n.rsplit(".", 1)[-1] for n in self.parts})
        self.vocab_size = shape.vocab_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def reports_loss(self) -> bool:
        """TP rank 0 of each replica: every TP rank of a replica trains the same samples."""
        return self.rank % self.tp_size == 0

    @property
    def gathers(self) -> bool:
        return self.dp_rank == 0

    @property
    def writes(self) -> bool:
        return self.rank == 0

    def forward_logprobs(self, batch: MicroBatch, slots: list[int], *, entropy: bool = False,
                         targets_BL: Tensor | None = None) -> Any:
        """`TorchTrainModel.forward_logprobs` on the Megatron shard (logits gathered over TP)."""
        with mlora.use_slots(self.module, slots):
            logits = forward_logits(self.module, self.shape, batch.input_ids_BL)
        if targets_BL is not None:  # every position scores its own target
            logprobs_BL = target_logprobs(logits, targets_BL)
            return (logprobs_BL, entropy_from_logits(logits)) if entropy else logprobs_BL
        logprobs = next_token_logprobs(logits, batch.input_ids_BL)
        if not entropy:
            return logprobs
        return logprobs, entropy_from_logits(logits[:, :-1])  # position t predicts token t + 1

    # ---- slots ------------------------------------------------------------------------------

    def init_slot(self, slot: int, *, rank: int, alpha: float, generator: torch.Generator) -> None:
        mlora.init_slot(self.parts, slot, rank=rank, alpha=alpha, generator=generator)

    def fresh_weights(self, *, rank: int, generator: torch.Generator) -> dict[str, tuple[Tensor, Tensor]]:
        return mlora.fresh_slot_weights(self.parts, rank=rank, generator=generator)

    def load_peft_dir(self, slot: int, path: Path) -> None:
        """Load a PEFT adapter directory (whole tensors) into `slot`, each part its shard."""
        tensors, config = read_peft_dir(path)
        rank, alpha = check_peft_config(config, path, covers=lambda t: t.rsplit(".", 1)[-1] in self.target_modules,
                                        lora_layers=self.target_modules,
                                        max_rank=next(iter(self.parts.values())).max_rank)
        mlora.set_slot_weights(self.parts, slot, tensors, rank=rank, alpha=alpha)

    def clear_slot(self, slot: int) -> None:
        mlora.clear_slot(self.parts, slot)

    def export_slot(self, slot: int) -> dict[str, Tensor]:
        if not self.gathers:
            return {}
        tensors = mlora.gather_slot_weights(self.parts, slot)
        return tensors if self.writes else {}

    # ---- gradients and checkpoint tensors ------------------------------------------------------

    def reduce_grads(self, grads: list[Tensor]) -> None:
        """Sum over the DP replicas (the same TP rank of each)."""
        from megatron.core import parallel_state

        if parallel_state.get_data_parallel_world_size() > 1:
            all_reduce_sum(grads, parallel_state.get_data_parallel_group())

    @torch.no_grad()
    def slot_grad_norm(self, grads: list[Tensor]) -> Tensor:
        """The slot's gradient norm over every TP shard: squares of sharded gradients summed
        over TP, replicated ones (equal on every rank) once."""
        norms = torch.stack(torch._foreach_norm(grads, dtype=torch.float32))
        sharded = torch.tensor([part.sharded == which for part, which in self._param_parts], device=norms.device)
        sq = norms.square()
        sharded_sq = sq[sharded].sum()
        if self.tp_size > 1:
            dist.all_reduce(sharded_sq, op=dist.ReduceOp.SUM, group=self._tp_group())
        return (sharded_sq + sq[~sharded].sum()).sqrt()

    def whole_tensors(self, tensors: list[Tensor], rank: int) -> dict[str, Tensor]:
        """Whole and rank-sliced by LoRA parameter name (a TP gather)."""
        return {n: part.gather(which, t, rank).cpu().contiguous()
                for n, t, (part, which) in zip(self.param_names, tensors, self._param_parts)}

    def gather_grad(self, grads: list[Tensor], rank: int) -> dict[str, Tensor]:
        grads = [g.detach().clone() for g in grads]
        self.reduce_grads(grads)
        if not self.gathers:
            return {}
        tensors = self.whole_tensors(grads, rank)
        return tensors if self.writes else {}

    def pad_slot_tensors(self, tensors: dict[str, Tensor], slot: int, rank: int, source: Path,
                         what: str) -> list[Tensor]:
        """Whole rank-sliced moments or gradients (HF shapes) -> this rank's padded slot views."""
        out = []
        for name, (param, rank_dim), (part, which) in zip(self.param_names, self.lora_params, self._param_parts):
            if name not in tensors:
                raise ValueError(f"checkpoint {source} has no {what} for {name}: it was saved for another model")
            whole = tensors[name]
            expected = (rank, part.in_features) if which == "A" else (part.out_features, rank)
            if tuple(whole.shape) != expected:
                raise ValueError(f"checkpoint {source}: {what} {name} has shape {list(whole.shape)}, "
                                 f"expected {list(expected)}")
            full = torch.zeros_like(param[slot])
            full.narrow(rank_dim - 1, 0, rank).copy_(part.shard_slot_view(which, whole))
            out.append(full)
        return out

    @staticmethod
    def _tp_group() -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()
