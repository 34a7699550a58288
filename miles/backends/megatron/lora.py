"""The slot page-table LoRA inside Megatron's column- and row-parallel linears.

Each Hugging Face linear an adapter targets (`q_proj` ... `down_proj`) is one
`LoRAPart` with `lora_A: [n_slots, max_rank, in]` and `lora_B: [n_slots, out, max_rank]`
sharded to match tensor parallelism, and a fused Megatron linear holds the parts it
fuses (`linear_qkv`: q, k, v; `linear_fc1`: gate, up):

- column-parallel (`linear_qkv`, `linear_fc1`): the input is whole on every TP rank, so
  A is replicated and B's output rows are sharded like the base weight's. The rank-r
  activation `h = x A^T` goes through `copy_to_tensor_model_parallel_region` (identity
  forward, all-reduce backward) so A's gradient is whole and equal on every rank.
- row-parallel (`linear_proj`, `linear_fc2`): the input columns are sharded, so A's input
  columns are sharded and B is replicated. The partial `h` of every rank is summed once,
  by `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward),
  before B; the base output is reduced by Megatron itself.

The parts of one fused linear share one collective on their concatenated `h` (rank-r
wide, so it costs little next to the base GEMMs). Samples of different slots share the
forward: one pair of GEMMs per slot present (slot -1 = base only). Slots are read and
written in PEFT's HF names and shapes (whole, not sharded), so exports, checkpoints and
fresh inits equal the torch backend's (`miles.lora`).

    parts = inject_parallel_lora(model, shape, n_slots=4, max_rank=8, target_modules="all-linear")
    init_slot(parts, 0, rank=8, alpha=16, generator=g)
    with use_slots(model, [0, 0, -1, 2]):
        logits = forward_logits(model, shape, input_ids_BS)

With activation recomputation the backward runs decoder layers again, after the block
has exited (the actor calls `backward()` outside it) and maybe on the autograd engine's
own thread: `tensor_parallel.checkpoint` is wrapped once (`keep_slots_in_recompute`) so
that every recomputed forward sees the slot batches of its first run.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from miles.backends.megatron.model import ModelShape
from miles.lora.model import resolve_targets
from miles.lora.slot_batch import SlotBatch
from miles.lora.slots import fresh_lora_weights, peft_names

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
HF_TARGETS = ATTENTION + MLP


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _all_gather(t: Tensor, dim: int) -> Tensor:
    """Every TP rank's `t`, concatenated along `dim` in rank order."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    _, size = _tp()
    if size == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


class LoRAPart(nn.Module):
    """One HF linear's slot page table, sharded for this TP rank."""

    def __init__(self, hf_name: str, *, parallel: str, in_features: int, out_features: int, n_slots: int,
                 max_rank: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        self.hf_name = hf_name
        self.parallel = parallel
        self.in_features, self.out_features = in_features, out_features
        self.tp_rank, self.tp_size = tp_rank, tp_size
        in_local = in_features // tp_size if parallel == "row" else in_features
        out_local = out_features // tp_size if parallel == "column" else out_features
        self.lora_A = nn.Parameter(torch.zeros(n_slots, max_rank, in_local))
        self.lora_B = nn.Parameter(torch.zeros(n_slots, out_local, max_rank))
        self.ranks = [0] * n_slots
        self.alphas = [0.0] * n_slots

    @property
    def max_rank(self) -> int:
        return self.lora_A.shape[1]

    @property
    def sharded(self) -> str:
        """Which of the two is split over TP ranks ("B" column-parallel, "A" row-parallel)."""
        return "B" if self.parallel == "column" else "A"

    def shard_dim(self, which: str) -> int | None:
        """The dim of a slot's [rank, in] / [out, rank] view that is split over TP, or None."""
        if which != self.sharded:
            return None
        return 0 if which == "B" else 1

    def scale(self, slot: int) -> float:
        return self.alphas[slot] / self.ranks[slot] if self.ranks[slot] else 0.0

    # ---- math --------------------------------------------------------------------------

    def down(self, x_BSI: Tensor, batch: SlotBatch) -> Tensor:
        """Scaled rank-space activation [B, S, max_rank] (partial over TP when row-parallel)."""
        x = x_BSI.to(self.lora_A.dtype)
        h = x.new_zeros(*x.shape[:-1], self.max_rank)
        for slot in batch.present:
            rows = batch.rows[slot]
            h = h.index_copy(0, rows, (x.index_select(0, rows) @ self.lora_A[slot].T) * self.scale(slot))
        return h

    def up(self, h_BSR: Tensor, batch: SlotBatch) -> Tensor:
        """This rank's delta [B, S, out_local] from the (reduced) rank-space activation."""
        out = h_BSR.new_zeros(*h_BSR.shape[:-1], self.lora_B.shape[1])
        for slot in batch.present:
            rows = batch.rows[slot]
            out = out.index_copy(0, rows, h_BSR.index_select(0, rows) @ self.lora_B[slot].T)
        return out

    # ---- slots in HF shapes ---------------------------------------------------------------

    def _shard(self, t: Tensor, dim: int | None) -> Tensor:
        return t if dim is None else t.chunk(self.tp_size, dim=dim)[self.tp_rank]

    @torch.no_grad()
    def set_slot(self, slot: int, a: Tensor, b: Tensor, *, alpha: float) -> None:
        """Write a whole (HF-shaped) A [rank, in] and B [out, rank] into this rank's shard."""
        rank = a.shape[0]
        if a.shape != (rank, self.in_features) or b.shape != (self.out_features, rank):
            raise ValueError(f"{self.hf_name}: expected lora_A [{rank}, {self.in_features}] and lora_B "
                             f"[{self.out_features}, {rank}], got {list(a.shape)} and {list(b.shape)}")
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"LoRA rank {rank} does not fit the slot width: need 0 < rank <= max_rank={self.max_rank}")
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.lora_A[slot, :rank].copy_(self._shard(a, self.shard_dim("A")))
        self.lora_B[slot, :, :rank].copy_(self._shard(b, self.shard_dim("B")))
        self.ranks[slot], self.alphas[slot] = rank, float(alpha)

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        self.ranks[slot], self.alphas[slot] = 0, 0.0

    def gather(self, which: str, slot_view: Tensor, rank: int) -> Tensor:
        """The whole HF-shaped tensor from this rank's slot view of A-shaped or B-shaped
        data (weights or moments), sliced to `rank`. A collective over TP when sharded."""
        local = slot_view[:rank] if which == "A" else slot_view[:, :rank]
        dim = self.shard_dim(which)
        return local.detach().clone() if dim is None else _all_gather(local.detach(), dim)

    def shard_slot_view(self, which: str, whole: Tensor) -> Tensor:
        """This rank's part of a whole HF-shaped A or B (the inverse of `gather`)."""
        return self._shard(whole, self.shard_dim(which))


class ParallelMultiLoRA(nn.Module):
    """A Megatron column/row-parallel linear plus the LoRA parts of the HF linears it holds."""

    def __init__(self, base: nn.Module, parts: dict[str, LoRAPart | None], *, parallel: str,
                 compose: Callable[[dict[str, Tensor | None], tuple[int, ...]], Tensor], router: SlotRouter) -> None:
        super().__init__()
        self.base = base
        present = {k: v for k, v in parts.items() if v is not None}
        self.parts = nn.ModuleDict(present)
        self._present: dict[str, LoRAPart] = present
        """`parts` by name, typed (the ModuleDict registers them as submodules)."""
        self.part_order = list(parts)
        self.parallel = parallel
        self.compose = compose
        self.router = router

    def forward(self, x: Tensor, *args, **kwargs):
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        out, bias = self.base(x, *args, **kwargs)
        batch = self.router.batch
        if batch is None or not batch.present:
            return out, bias
        x_BSI = x.transpose(0, 1)  # Megatron runs [S, B, H]; slots index the batch
        if x_BSI.shape[0] != batch.batch_size:
            raise ValueError(f"use_slots gave {batch.batch_size} slot ids but the layer input has batch size "
                             f"{x_BSI.shape[0]}: pass one slot id per sample")
        parts = self._present
        names = list(parts)
        h_BSR = torch.cat([parts[n].down(x_BSI, batch) for n in names], dim=-1)
        if self.parallel == "column":
            h_BSR = copy_to_tensor_model_parallel_region(h_BSR)
        else:
            h_BSR = reduce_from_tensor_model_parallel_region(h_BSR)
        pieces = h_BSR.split([parts[n].max_rank for n in names], dim=-1)
        deltas: dict[str, Tensor | None] = {n: None for n in self.part_order}
        for n, h in zip(names, pieces):
            deltas[n] = parts[n].up(h, batch)
        delta_BSO = self.compose(deltas, tuple(x_BSI.shape[:2]))
        return out + delta_BSO.transpose(0, 1).to(out.dtype), bias


class SlotRouter:
    """The slot batch of the forward being run, shared by every LoRA layer of one model."""

    def __init__(self) -> None:
        self.batch: SlotBatch | None = None
        _ROUTERS.add(self)


# Every live router, for the recomputed forwards to find (`keep_slots_in_recompute`).
_ROUTERS: weakref.WeakSet[SlotRouter] = weakref.WeakSet()


def keep_slots_in_recompute() -> None:
    """Route Megatron's recomputed forwards (full and selective) through the slot batches
    of their first run (idempotent). `TransformerBlock` and `Attention` call the checkpoint
    as `tensor_parallel.checkpoint`, so that package attribute is the one wrapped."""
    from megatron.core import tensor_parallel

    if not getattr(tensor_parallel.checkpoint, "keeps_slots", False):
        tensor_parallel.checkpoint = _checkpoint_keeping_slots(tensor_parallel.checkpoint)


def _checkpoint_keeping_slots(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`checkpoint(function, distribute_saved_activations, *args)` whose `function`, when the
    backward runs it again, sees the batches every router held at the forward (and puts
    back what they hold after)."""

    @functools.wraps(checkpoint)
    def run(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any) -> Any:
        routing = [(router, router.batch) for router in _ROUTERS]

        def replay(*inputs: Any) -> Any:
            held = [(router, router.batch) for router, _ in routing]
            for router, batch in routing:
                router.batch = batch
            try:
                return function(*inputs)
            finally:
                for router, batch in held:
                    router.batch = batch

        return checkpoint(replay, distribute_saved_activations, *args)

    run.keeps_slots = True  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def use_slots(model: nn.Module, slot_ids: Sequence[int]) -> Iterator[SlotBatch]:
    """Route sample i of the forwards run inside the block through slot `slot_ids[i]` (-1: base).

    A layer recomputed in the backward keeps the slots of its forward
    (`keep_slots_in_recompute`), so `backward()` may run after the block."""
    router = model.lora_router
    if not isinstance(router, SlotRouter):
        raise TypeError(f"{type(model).__name__}.lora_router is a {type(router).__name__}, not a SlotRouter")
    parts = lora_parts(model)
    n_slots = next(iter(parts.values())).lora_A.shape[0]
    batch = SlotBatch.build(slot_ids, next(iter(parts.values())).lora_A.device)
    for slot in batch.present:
        if slot >= n_slots:
            raise ValueError(f"slot {slot} does not exist: the page table has {n_slots} slots (0..{n_slots - 1})")
    previous, router.batch = router.batch, batch
    try:
        yield batch
    finally:
        router.batch = previous


# ---- injection ------------------------------------------------------------------------


def _zeros_or(delta: Tensor | None, lead: tuple[int, ...], width: int, like: Tensor) -> Tensor:
    return like.new_zeros(*lead, width) if delta is None else delta


def _qkv_composer(shape: ModelShape, tp_size: int):
    groups = shape.num_query_groups // tp_size
    per_group, d = shape.num_heads // shape.num_query_groups, shape.head_dim

    def compose(deltas: dict[str, Tensor | None], lead: tuple[int, ...]) -> Tensor:
        like = next(t for t in deltas.values() if t is not None)
        q = _zeros_or(deltas["q_proj"], lead, groups * per_group * d, like).reshape(*lead, groups, per_group * d)
        k = _zeros_or(deltas["k_proj"], lead, groups * d, like).reshape(*lead, groups, d)
        v = _zeros_or(deltas["v_proj"], lead, groups * d, like).reshape(*lead, groups, d)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)

    return compose


def _fc1_composer(shape: ModelShape, tp_size: int):
    width = shape.ffn_hidden_size // tp_size

    def compose(deltas: dict[str, Tensor | None], lead: tuple[int, ...]) -> Tensor:
        like = next(t for t in deltas.values() if t is not None)
        return torch.cat([_zeros_or(deltas["gate_proj"], lead, width, like),
                          _zeros_or(deltas["up_proj"], lead, width, like)], dim=-1)

    return compose


def _single(name: str):
    return lambda deltas, lead: deltas[name]


def inject_parallel_lora(model: nn.Module, shape: ModelShape, *, n_slots: int, max_rank: int,
                         target_modules: str | Sequence[str]) -> dict[str, LoRAPart]:
    """Wrap the targeted Megatron linears in place; return the parts by HF module name
    (in HF module order, the order a fresh init draws A in)."""
    if n_slots <= 0 or max_rank <= 0:
        raise ValueError(f"n_slots and max_rank must be > 0, got n_slots={n_slots}, max_rank={max_rank}")
    targets = resolve_targets(target_modules)
    targets = set(HF_TARGETS) if targets is None else targets
    unknown = targets - set(HF_TARGETS)
    if unknown:
        raise ValueError(f"target_modules {sorted(unknown)} are not linears of a Llama/Qwen2 decoder layer "
                         f"(the Megatron backend targets {list(HF_TARGETS)})")
    tp_rank, tp_size = _tp()
    keep_slots_in_recompute()
    router = SlotRouter()
    # A plain attribute, as nn.Module.__setattr__ stores one (its typing allows tensors and modules only).
    object.__setattr__(model, "lora_router", router)
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q_out, kv_out = shape.num_heads * shape.head_dim, shape.num_query_groups * shape.head_dim
    dims = {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    fused = [("self_attention.linear_qkv", "self_attn", ("q_proj", "k_proj", "v_proj"), "column",
              _qkv_composer(shape, tp_size)),
             ("self_attention.linear_proj", "self_attn", ("o_proj",), "row", _single("o_proj")),
             ("mlp.linear_fc1", "mlp", ("gate_proj", "up_proj"), "column", _fc1_composer(shape, tp_size)),
             ("mlp.linear_fc2", "mlp", ("down_proj",), "row", _single("down_proj"))]
    out: dict[str, LoRAPart] = {}
    for i in range(shape.num_layers):
        for megatron_name, hf_block, names, parallel, compose in fused:
            if not targets & set(names):
                continue
            parts: dict[str, LoRAPart | None] = {}
            for name in names:
                if name not in targets:
                    parts[name] = None
                    continue
                in_f, out_f = dims[name]
                part = LoRAPart(f"model.layers.{i}.{hf_block}.{name}", parallel=parallel, in_features=in_f,
                                out_features=out_f, n_slots=n_slots, max_rank=max_rank,
                                tp_rank=tp_rank, tp_size=tp_size)
                parts[name] = out[part.hf_name] = part
            parent_name, _, child = f"decoder.layers.{i}.{megatron_name}".rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, ParallelMultiLoRA(getattr(parent, child), parts, parallel=parallel,
                                                     compose=compose, router=router))
    order = {name: k for k, name in enumerate(HF_TARGETS)}
    return dict(sorted(out.items(), key=lambda kv: (int(kv[0].split(".")[2]), order[kv[0].rsplit(".", 1)[1]])))


def lora_parts(model: nn.Module) -> dict[str, LoRAPart]:
    """Every LoRA part of the model by HF module name, in HF module order."""
    parts = {m.hf_name: m for m in model.modules() if isinstance(m, LoRAPart)}
    if not parts:
        raise ValueError("model has no LoRA parts: call inject_parallel_lora first")
    order = {name: k for k, name in enumerate(HF_TARGETS)}
    return dict(sorted(parts.items(), key=lambda kv: (int(kv[0].split(".")[2]), order[kv[0].rsplit(".", 1)[1]])))


# ---- slots, in PEFT names (whole tensors) ---------------------------------------------


def fresh_slot_weights(parts: dict[str, LoRAPart], *, rank: int, generator: torch.Generator | None = None
                       ) -> dict[str, tuple[Tensor, Tensor]]:
    """A fresh adapter's whole (A, B) per HF module name: `fresh_lora_weights` in HF module
    order, so the draws are the torch backend's."""
    shapes = {name: (part.in_features, part.out_features) for name, part in parts.items()}
    return fresh_lora_weights(shapes, rank=rank, generator=generator)


def init_slot(parts: dict[str, LoRAPart], slot: int, *, rank: int, alpha: float,
              generator: torch.Generator | None = None) -> None:
    """Fresh adapter (`fresh_slot_weights`), each part's share written to its slot."""
    for name, (a, b) in fresh_slot_weights(parts, rank=rank, generator=generator).items():
        parts[name].set_slot(slot, a, b, alpha=alpha)


def set_slot_weights(parts: dict[str, LoRAPart], slot: int, tensors: dict[str, Tensor], *, rank: int,
                     alpha: float) -> None:
    """Load an adapter given in PEFT names (whole tensors) into `slot`; parts it does not
    cover get a zero delta. Unknown names raise before anything is written."""
    by_name = {}
    known = set()
    for name in parts:
        a_name, b_name = peft_names(name)
        known |= {a_name, b_name}
        if (a_name in tensors) != (b_name in tensors):
            raise ValueError(f"adapter has lora_A without lora_B (or the reverse) for {name}")
        if a_name in tensors:
            by_name[name] = (tensors[a_name], tensors[b_name])
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ValueError(f"{len(unknown)} adapter tensors match no LoRA layer of this model (e.g. {unknown[:5]}); "
                         "the Megatron backend's target modules must cover the adapter's")
    for name, part in parts.items():
        a, b = by_name.get(name, (torch.zeros(rank, part.in_features), torch.zeros(part.out_features, rank)))
        part.set_slot(slot, a.float(), b.float(), alpha=alpha)


def clear_slot(parts: dict[str, LoRAPart], slot: int) -> None:
    for part in parts.values():
        part.clear_slot(slot)


def gather_slot_weights(parts: dict[str, LoRAPart], slot: int) -> dict[str, Tensor]:
    """Slot `slot`'s adapter in PEFT names, whole (gathered over TP: every rank must call)."""
    first = next(iter(parts.values()))
    rank = first.ranks[slot]
    if rank == 0:
        raise ValueError(f"slot {slot} is empty: load an adapter into it first")
    out = {}
    for name, part in parts.items():
        a_name, b_name = peft_names(name)
        out[a_name] = part.gather("A", part.lora_A[slot], rank).cpu().contiguous()
        out[b_name] = part.gather("B", part.lora_B[slot], rank).cpu().contiguous()
    return out
