"""The model side of a train rank: what `TrainCore` asks of a backend's model.

A backend implements `TrainModel` over its own model (the torch backend over a Hugging
Face causal LM with the slot page table injected, `miles.backends.torch.train_model`; the
Megatron backend over a GPTModel shard with the page table in its parallel linears,
`miles.backends.megatron.train_model`). Everything else a rank does, loads and resumes,
micro-batches, the loss, the step and checkpoints, is `TrainCore`'s and the same for both.

Tensors keyed by LoRA parameter name (`param_names`: `"{module}.lora_A"`, `"{module}.lora_B"`
with the Hugging Face module names) are whole and rank-sliced: the shapes a checkpoint
holds, whatever the model's sharding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol, overload

import torch
import torch.distributed as dist
from torch import Tensor

from miles.backends.common.batching import MicroBatch
from miles.backends.common.optimizer import SlotNorm


class TrainModel(Protocol):
    """A frozen base model with a slot page table of LoRA A/B rows, on one rank."""

    param_names: list[str]
    """The LoRA parameters' names, in `lora_params` order."""
    lora_params: list[tuple[torch.nn.Parameter, int]]
    """(parameter, rank dimension) of every LoRA tensor of this rank, slot in dimension 0:
    what `SlotAdamW` steps."""
    target_modules: list[str]
    """Short names of the layers with LoRA (`q_proj`, ...), as `adapter_config.json` lists them."""
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica."""

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's loss sums count: one rank per replica reports (every TP rank of a
        replica trains the same samples)."""

    @property
    def gathers(self) -> bool:
        """Whether this rank takes part in gathering whole tensors for exports and saves (a torch
        rank gathers alone; Megatron: the TP group of replica 0)."""

    @property
    def writes(self) -> bool:
        """Whether this rank's gathers hold the whole tensors, so it can write a checkpoint."""

    @property
    def vocab_size(self) -> int:
        """Tokens the model scores (a client datum's tokens and targets must be below it)."""

    @property
    def slot_grad_norm(self) -> SlotNorm | None:
        """The norm of one slot's gradient when its tensors are sharded over ranks (Megatron: over
        TP, `SlotAdamW.step_slots(slot_norm=...)`); None: this rank holds whole rows, and the
        optimizer's fused step takes each slot's norm itself."""

    @overload
    def forward_logprobs(self, batch: MicroBatch, slots: list[int], *, entropy: Literal[False] = False,
                         targets_BL: Tensor | None = None) -> Tensor: ...

    @overload
    def forward_logprobs(self, batch: MicroBatch, slots: list[int], *, entropy: Literal[True],
                         targets_BL: Tensor | None = None) -> tuple[Tensor, Tensor]: ...

    def forward_logprobs(self, batch: MicroBatch, slots: list[int], *, entropy: bool = False,
                         targets_BL: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Next-token logprobs [B, L-1] of `batch` with one slot per row (-1: the base alone);
        with `entropy`, also the entropy of each of those next-token distributions [B, L-1].
        Only response positions are read.

        With `targets_BL` (a mixed batch's `target_tokens_BL`): the logprob of
        `targets_BL[:, t]` at every position t, [B, L] (and the entropy [B, L]); every
        position is computed (client rows read them all)."""

    def init_slot(self, slot: int, *, rank: int, alpha: float, generator: torch.Generator) -> None:
        """A fresh adapter in `slot`: A drawn from `generator`, B zero."""

    def fresh_weights(self, *, rank: int, generator: torch.Generator) -> dict[str, tuple[Tensor, Tensor]]:
        """What `init_slot` draws with this generator, whole, per module name; nothing written."""

    def load_peft_dir(self, slot: int, path: Path) -> None:
        """The LoRA weights of the PEFT directory `path` into `slot`."""

    def clear_slot(self, slot: int) -> None:
        """Zero `slot`'s weights and forget its rank and scale."""

    def export_slot(self, slot: int) -> dict[str, Tensor]:
        """The slot's LoRA tensors, whole, in PEFT names, sliced to its rank (CPU); empty on a
        rank that does not write (every rank that `gathers` must call)."""

    def reduce_grads(self, grads: list[Tensor]) -> None:
        """Sum `grads` over the data-parallel replicas, in place (every rank calls)."""

    def whole_tensors(self, tensors: list[Tensor], rank: int) -> dict[str, Tensor]:
        """This rank's rows of one slot (`tensors` in `lora_params` order: moments) as whole
        CPU tensors sliced to `rank`, by LoRA parameter name (every rank that `gathers` calls)."""

    def gather_grad(self, grads: list[Tensor], rank: int) -> dict[str, Tensor]:
        """One slot's gradient toward its next step (`grads`: this rank's live rows, left as they
        are) as whole CPU tensors sliced to `rank`, by LoRA parameter name: a torch rank's own
        share (the train group sums the shares); Megatron: summed over the replicas and
        gathered over TP (every rank calls), on global rank 0 only, empty elsewhere."""

    def pad_slot_tensors(self, tensors: dict[str, Tensor], slot: int, rank: int, source: Path,
                         what: str) -> list[Tensor]:
        """Whole rank-sliced tensors by LoRA parameter name (moments or a gradient read from the
        checkpoint `source`) as this rank's rows of `slot`, zero-padded past `rank`, in
        `lora_params` order. ValueError naming `source` and `what` when one is missing or
        has another shape."""


def all_reduce_sum(tensors: list[Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Sum `tensors` over the ranks of `group` (default: every rank) in place, as one flat
    all-reduce."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
