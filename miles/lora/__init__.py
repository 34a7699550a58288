"""Slot page-table LoRA: many adapters on one frozen Hugging Face causal LM.

    from miles.lora import inject_multi_lora, init_slot, use_slots
    inject_multi_lora(model, n_slots=4, max_rank=8, target_modules="all-linear")
    init_slot(model, 0, rank=8, alpha=16)
    with use_slots(model, [0, 1, -1]):   # one slot per sample; -1 = base only
        logits = model(input_ids_BT).logits

Slots are read and written in PEFT's names and directory format, so what a slot holds
loads with `peft.PeftModel.from_pretrained` and PEFT-made adapters load into slots.
"""

from miles.lora.delta import DeltaMode
from miles.lora.layer import MultiLoRALinear
from miles.lora.model import inject_multi_lora, lora_modules, set_delta_mode, slot_parameters, use_slots
from miles.lora.peft_io import (
    export_peft_adapter,
    load_peft_adapter,
    load_peft_tensors,
    peft_adapter_config,
    read_peft_dir,
    write_peft_dir,
)
from miles.lora.routing import active_routing, restore_routing
from miles.lora.slot_batch import SlotBatch
from miles.lora.slots import (
    clear_slot,
    fresh_slot_weights,
    get_slot_weights,
    init_slot,
    peft_names,
    peft_tensors,
    set_slot_weights,
    slot_rank_alpha,
)

__all__ = [
    "DeltaMode",
    "MultiLoRALinear",
    "SlotBatch",
    "active_routing",
    "clear_slot",
    "export_peft_adapter",
    "fresh_slot_weights",
    "get_slot_weights",
    "init_slot",
    "inject_multi_lora",
    "load_peft_adapter",
    "load_peft_tensors",
    "lora_modules",
    "peft_adapter_config",
    "peft_names",
    "peft_tensors",
    "read_peft_dir",
    "restore_routing",
    "set_delta_mode",
    "set_slot_weights",
    "slot_parameters",
    "slot_rank_alpha",
    "use_slots",
    "write_peft_dir",
]
