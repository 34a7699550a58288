"""The delta strategies of a multi-LoRA layer, one module each; all give the same numbers.

    segment   one GEMM pair per present slot (slot-sorted training batches, one adapter)
    gather    the rows grouped per slot, one batched GEMM pair (unsorted or equal-count batches)
    stacked   every slot up to the highest present one as one wide LoRA (decode, few rows)
    jagged    the rows sorted by slot, one grouped GEMM pair (decode, many rows)
    rowwise   each row through its own slot in one C call (float32 CPU decode)

A strategy is `forward(layer, x, batch) -> base(x) + delta` (`miles.lora.delta.base`); a new
one is one more module and one more entry in `STRATEGIES`. `MultiLoRALinear` picks one per
batch ("auto") or runs the one its `delta_mode` names.
"""

from __future__ import annotations

from typing import Literal

from miles.lora.delta import gather, jagged, rowwise, segment, stacked
from miles.lora.delta.base import DeltaStrategy

DeltaMode = Literal["auto", "segment", "gather", "stacked", "jagged", "rowwise"]

STRATEGIES: dict[str, DeltaStrategy] = {
    "segment": segment.forward,
    "gather": gather.forward,
    "stacked": stacked.forward,
    "jagged": jagged.forward,
    "rowwise": rowwise.forward,
}
"""Every delta mode but "auto", in `DeltaMode`'s order."""
