"""The row-wise decode kernel: each row of a decode step through its own slot only, on CPU.

    kernel = rowwise_kernel()            # None where it cannot be built
    if kernel is not None:
        kernel(out_NO, x_NI, a_SIR, b_SRO, slots_N, scale_N, order_M)   # out_NO += delta, in place

`rowwise.c` is compiled on first use with the system C compiler (`$CC`, else `cc`) into
`$MILES_KERNEL_CACHE` (default `~/.cache/miles/kernels`), one file per source, flags,
compiler and CPU (`miles.lora.native.build_library`); it is loaded with ctypes (no Python
headers, no torch ABI: a build takes a fraction of a second). Where no compiler works, or
with `MILES_CPU_LORA_KERNEL=0`, `rowwise_kernel()` returns None and decode steps take the
torch paths; the reason is logged once.

Why a kernel: a decode step of a few rows over several adapters is a few thousand
multiply-adds per row, which torch can only reach as one GEMM over every slot's columns
(the stacked path: (highest slot + 1) x the work) or one small GEMM per slot (jagged).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from miles.lora.native import build_library, c_compiler, cpu_fingerprint, switched_off

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rowwise.c")
FLAGS = ("-O3", "-std=c11", "-fopenmp-simd", "-shared", "-fPIC")
NATIVE_FLAGS = ("-march=native",)
"""Tried first; the build is for this machine only (the cache key names its CPU)."""
ENV_SWITCH = "MILES_CPU_LORA_KERNEL"


class RowwiseKernel:
    """The loaded `lora_rowwise` function with its argument types."""

    def __init__(self, path: Path):
        self.path = path
        self._fn = ctypes.CDLL(str(path)).lora_rowwise
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 4

    def __call__(self, out_NO: torch.Tensor, x_NI: torch.Tensor, a_SIR: torch.Tensor, b_SRO: torch.Tensor,
                 slots_N: torch.Tensor, scale_N: torch.Tensor, order_M: torch.Tensor) -> torch.Tensor:
        """`out_NO[n] += scale_N[n] * x_NI[n] @ a_SIR[s] @ b_SRO[s]` (s = slots_N[n]) for the rows in
        `order_M`, in place. Float32 and int64 CPU tensors, contiguous; unchecked here (the caller,
        `MultiLoRALinear`, builds them once per decode plan)."""
        self.call_raw(out_NO.data_ptr(), x_NI.data_ptr(), plan_arguments(a_SIR, b_SRO, slots_N, scale_N, order_M))
        return out_NO

    def call_raw(self, out_ptr: int, x_ptr: int, fixed: tuple[int, ...]) -> None:
        """The same call with the per-plan pointers and sizes bound (`plan_arguments`)."""
        self._fn(out_ptr, x_ptr, *fixed)


def plan_arguments(a_SIR: torch.Tensor, b_SRO: torch.Tensor, slots_N: torch.Tensor, scale_N: torch.Tensor,
                   order_M: torch.Tensor) -> tuple[int, ...]:
    """What stays the same over the steps of one decode plan, as the kernel takes it."""
    return (a_SIR.data_ptr(), b_SRO.data_ptr(), slots_N.data_ptr(), scale_N.data_ptr(), order_M.data_ptr(),
            order_M.numel(), a_SIR.shape[1], a_SIR.shape[2], b_SRO.shape[2])


@functools.cache
def rowwise_kernel() -> RowwiseKernel | None:
    """The kernel, built or loaded from the cache once per process; None (with the reason
    logged once) where it is switched off or no C compiler builds it."""
    if switched_off(ENV_SWITCH):
        logger.info("%s=0: decode steps of several adapters take the torch paths", ENV_SWITCH)
        return None
    try:
        return RowwiseKernel(_build())
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logger.warning("the row-wise LoRA decode kernel is not available (%s); decode steps of several "
                       "adapters take the torch paths, which are slower on CPU", exc)
        return None


def _build() -> Path:
    return build_library(SOURCE, "lora_rowwise", c_compiler(), [FLAGS + NATIVE_FLAGS, FLAGS], key=cpu_fingerprint())
