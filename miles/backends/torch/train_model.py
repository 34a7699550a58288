"""The torch backend's `TrainModel`: a frozen Hugging Face causal LM with the slot page table.

Every data-parallel rank holds the whole model, so its slot tensors are whole: exports,
moments and gradients are its own rows sliced to the adapter's rank, every rank reports
its loss sums and can write a checkpoint, and gradients are summed over all ranks.

    model = TorchTrainModel(TrainActorConfig(hf_checkpoint="/tmp/tiny", n_slots=4, lora_rank=8))
    core = TrainCore(config, model)                     # as `TorchTrainActor` composes them
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from miles.backends.common.batching import (
    CPU_ACTIVATION_BUDGET_MB,
    ActivationBudget,
    MicroBatch,
    activation_bytes_per_token,
    logits_to_keep,
    next_token_logprobs,
    target_logprobs,
)
from miles.backends.common.loss import entropy_from_logits
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.model import all_reduce_sum
from miles.backends.torch.lm_head import (
    CHUNK_LOGITS,
    fused_head_weight,
    head_lora_layer,
    lm_head_logprobs,
    slot_head_lora,
)
from miles.backends.torch.recompute import apply_recompute
from miles.lora import (
    clear_slot,
    fresh_slot_weights,
    get_slot_weights,
    init_slot,
    inject_multi_lora,
    load_peft_adapter,
    lora_modules,
    use_slots,
)

WINDOW_MIN_SKIPPED_LOGITS = 2**16
"""The forward computes logits on the response window only when that skips at least this
many logits (rows x prompt positions x vocabulary): below it the LM head costs nothing
worth a gather, and small GEMMs of another row count round differently."""
FUSED_HEAD_MIN_LOGITS = CHUNK_LOGITS
"""The LM head is fused with the logprobs (`lm_head_logprobs`) when the window's logits
(rows x positions x vocabulary) exceed one chunk of it: below that the logits take no more
memory than the fused head's chunk buffers, and the model's own head keeps its numbers."""


class TorchTrainModel:
    """A Hugging Face causal LM with the slot page table injected, as one data-parallel rank holds it."""

    reports_loss = True
    gathers = True
    writes = True
    slot_grad_norm = None

    def __init__(self, config: TrainActorConfig, rank: int = 0, world_size: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        module = AutoModelForCausalLM.from_pretrained(config.hf_checkpoint, dtype=config.torch_dtype)
        module_names = inject_multi_lora(
            module, n_slots=config.n_slots, max_rank=config.lora_rank, target_modules=config.target_modules
        )
        # eval(): no dropout, so the logprobs of a pass equal the ones the loss uses as "old".
        as_module: nn.Module = module  # mypy takes `PreTrainedModel.to` (a functools.wraps) for unbound
        as_module.to(torch.device(config.device))  # in place, as any module's
        self.module = module.eval()
        """The Hugging Face model (`use_slots(model.module, slots)` routes its LoRA layers)."""
        apply_recompute(self.module, config.recompute_granularity, config.recompute_method,
                        config.recompute_num_layers, config.recompute_modules)
        modules = lora_modules(self.module)
        # LoRA weights and their AdamW moments stay fp32 over a bf16 base: updates of
        # lr ~ 1e-4 would round away in bf16.
        for layer in modules.values():
            layer.lora_A.data = layer.lora_A.data.float()
            layer.lora_B.data = layer.lora_B.data.float()
        self.param_names: list[str] = []
        self.lora_params: list[tuple[torch.nn.Parameter, int]] = []
        for name, layer in modules.items():
            self.param_names += [f"{name}.lora_A", f"{name}.lora_B"]
            self.lora_params += [(layer.lora_A, 1), (layer.lora_B, 2)]
        self.target_modules = sorted({n.rsplit(".", 1)[-1] for n in module_names})
        self.dp_rank = rank
        self.world_size = world_size
        self.vocab_size: int = self.module.config.get_text_config().vocab_size

    def activation_budget(self, config: TrainActorConfig) -> ActivationBudget | None:
        """Micro-batches sized by `config.activation_budget_mb` (default: on CPU only) and this
        model's shape; None: the whole batch."""
        budget_mb = config.activation_budget_mb
        if budget_mb is None:
            budget_mb = CPU_ACTIVATION_BUDGET_MB if torch.device(config.device).type == "cpu" else 0
        if not budget_mb:
            return None
        return ActivationBudget(int(budget_mb * 2**20), activation_bytes_per_token(
            self.module.config, torch.finfo(config.torch_dtype).bits // 8, config.recompute_granularity,
        ))

    def forward_logprobs(self, batch: MicroBatch, slots: list[int], *, entropy: bool = False,
                         targets_BL: Tensor | None = None) -> Any:
        """Next-token logprobs [B, L-1]; with `entropy`, also the entropy of each of those
        next-token distributions [B, L-1]. With `targets_BL`: `_target_logprobs`.

        The LM head runs on the response window only (`logits_to_keep`): no logits, log-softmax
        or their gradients for prompt positions that predict no response token in any row.
        Positions before the window read 0 (logprob and entropy); every loss term and every
        caller reads response positions only, so the numbers are those of the full forward.
        Where the head is a plain linear (`fused_head_weight`) and the window's logits are
        large (`FUSED_HEAD_MIN_LOGITS`), it is fused with the logprobs (`lm_head_logprobs`):
        no [B, K, vocab] logits or gradient are ever held.
        """
        if targets_BL is not None:
            return self._target_logprobs(batch, slots, targets_BL, entropy)
        model = self.module
        length, keep = batch.input_ids_BL.shape[1], logits_to_keep(batch)
        vocab = model.config.get_text_config().vocab_size
        if len(slots) * (length - keep) * vocab < WINDOW_MIN_SKIPPED_LOGITS:
            keep = length
        head_VH = fused_head_weight(model)
        if head_VH is not None and len(slots) * keep * vocab > FUSED_HEAD_MIN_LOGITS:
            with use_slots(model, slots):
                hidden_BLH = model.get_decoder()(
                    input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False,
                ).last_hidden_state
            start = length - keep  # position t predicts token t + 1; the last one predicts nothing
            hidden_BKH = hidden_BLH[:, start:-1]
            out = lm_head_logprobs(hidden_BKH, head_VH, batch.input_ids_BL[:, start + 1 :], entropy=entropy,
                                   lora=self._head_lora(hidden_BKH, slots))
            if isinstance(out, Tensor):  # no entropy asked
                return torch.nn.functional.pad(out, (start, 0))
            return tuple(torch.nn.functional.pad(x_BK, (start, 0)) for x_BK in out)
        # Positions as a tensor, not the int `keep`: the model gathers them into a contiguous
        # [B, K, H] block, one GEMM for the LM head; an int slices a strided view, which the
        # linear layer runs as a batched GEMM slower than the full head (CPU).
        window_K = torch.arange(length - keep, length, device=batch.input_ids_BL.device)
        with use_slots(model, slots):
            logits_BKV = model(
                input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False,
                logits_to_keep=window_K,
            ).logits
        logprobs_BT = next_token_logprobs(logits_BKV, batch.input_ids_BL)
        if not entropy:
            return logprobs_BT
        # kept position k predicts token L - keep + k + 1; the last kept one predicts nothing
        entropy_BT = entropy_from_logits(logits_BKV[:, :-1])
        return logprobs_BT, torch.nn.functional.pad(entropy_BT, (logprobs_BT.shape[1] - entropy_BT.shape[1], 0))

    def _target_logprobs(self, batch: MicroBatch, slots: list[int], targets_BL: Tensor, entropy: bool) -> Any:
        """The logprob of `targets_BL[:, t]` at every position t, [B, L] (with `entropy`, also
        each position's entropy): the whole sequence's logits, through the fused head where
        `forward_logprobs` would fuse it."""
        model = self.module
        batch_size, length = batch.input_ids_BL.shape
        head_VH = fused_head_weight(model)
        if head_VH is not None and batch_size * length * self.vocab_size > FUSED_HEAD_MIN_LOGITS:
            with use_slots(model, slots):
                hidden_BLH = model.get_decoder()(
                    input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False,
                ).last_hidden_state
            return lm_head_logprobs(hidden_BLH, head_VH, targets_BL, entropy=entropy,
                                    lora=self._head_lora(hidden_BLH, slots))
        with use_slots(model, slots):
            logits_BLV = model(input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL,
                               use_cache=False).logits
        logprobs_BL = target_logprobs(logits_BLV, targets_BL)
        return (logprobs_BL, entropy_from_logits(logits_BLV)) if entropy else logprobs_BL

    def _head_lora(self, hidden_BTH: Tensor, slots: list[int]) -> tuple[Tensor, Tensor] | None:
        """The slots' LoRA on the head for the fused head (`--lora-unembed`); None: a plain head."""
        layer = head_lora_layer(self.module)
        return None if layer is None else slot_head_lora(layer, hidden_BTH, slots)

    # ---- slots ---------------------------------------------------------------------------

    def init_slot(self, slot: int, *, rank: int, alpha: float, generator: torch.Generator) -> None:
        init_slot(self.module, slot, rank=rank, alpha=alpha, generator=generator)

    def fresh_weights(self, *, rank: int, generator: torch.Generator) -> dict[str, tuple[Tensor, Tensor]]:
        return fresh_slot_weights(self.module, rank=rank, generator=generator)

    def load_peft_dir(self, slot: int, path: Path) -> None:
        load_peft_adapter(self.module, slot, path)

    def clear_slot(self, slot: int) -> None:
        clear_slot(self.module, slot)

    def export_slot(self, slot: int) -> dict[str, Tensor]:
        return get_slot_weights(self.module, slot)

    # ---- gradients and checkpoint tensors ---------------------------------------------------

    def reduce_grads(self, grads: list[Tensor]) -> None:
        if self.world_size > 1:
            all_reduce_sum(grads)

    def whole_tensors(self, tensors: list[Tensor], rank: int) -> dict[str, Tensor]:
        return {n: t.narrow(dim - 1, 0, rank).contiguous().cpu()
                for n, t, (_, dim) in zip(self.param_names, tensors, self.lora_params)}

    def gather_grad(self, grads: list[Tensor], rank: int) -> dict[str, Tensor]:
        return {n: g.narrow(dim - 1, 0, rank).detach().cpu().clone()
                for n, g, (_, dim) in zip(self.param_names, grads, self.lora_params)}

    def pad_slot_tensors(self, tensors: dict[str, Tensor], slot: int, rank: int, source: Path,
                         what: str) -> list[Tensor]:
        out = []
        for name, (param, rank_dim) in zip(self.param_names, self.lora_params):
            if name not in tensors:
                raise ValueError(f"checkpoint {source} has no {what} for {name}: it was saved for another model")
            full = torch.zeros_like(param[slot])
            region = full.narrow(rank_dim - 1, 0, rank)
            if tensors[name].shape != region.shape:
                raise ValueError(f"checkpoint {source}: {what} {name} has shape {list(tensors[name].shape)}, "
                                 f"expected {list(region.shape)}")
            region.copy_(tensors[name])
            out.append(full)
        return out
