"""Allocator settings for the CPU train ranks: glibc's, and torch's CPU allocator.

    keep_freed_memory()   # at the start of a CPU train rank, before its model is loaded
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from miles.lora.native import build_library, cxx_compiler, switched_off

logger = logging.getLogger(__name__)

ALLOCATOR_SOURCE = Path(__file__).with_name("cpu_allocator.cpp")
ENV_SWITCH = "MILES_CPU_ALLOCATOR"


def keep_freed_memory() -> None:
    """Have glibc serve large CPU tensors from the heap, keep freed memory for reuse, and
    let a freed tensor's block take the next tensor of its size.

    A train step allocates and frees tensors of hundreds of MB (activations, and logits
    where the LM head is not fused); glibc maps every allocation over 32 MB afresh and
    unmaps it when freed, so each step page-faults all of it in again (~100k faults and
    ~10% of a step on a 60M model). With mmap off and no trimming below 2 GB the memory
    is reused from step to step. Freed blocks stay resident, so the holes that no later
    tensor fits add to the peak: `use_heap_cpu_allocator` makes blocks of one size fit
    each other (60M train step: heap 1.25 -> 0.99 GB). A no-op outside glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's mallopt parameter numbers
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)
    use_heap_cpu_allocator()


@functools.cache
def use_heap_cpu_allocator() -> bool:
    """Serve torch's CPU tensors from plain malloc, aligned by hand (`cpu_allocator.cpp`),
    for the rest of the process; True when installed. Built on first use with the system
    C++ compiler against this torch; where it cannot be built, or with
    `MILES_CPU_ALLOCATOR=0`, torch's own allocator stays (the reason is logged once)."""
    if switched_off(ENV_SWITCH):
        logger.info("%s=0: CPU tensors come from torch's own allocator", ENV_SWITCH)
        return False
    torch_dir = Path(torch.__file__).parent
    flags = ("-O2", "-std=c++17", "-shared", "-fPIC", f"-I{torch_dir / 'include'}", f"-L{torch_dir / 'lib'}",
             "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}")
    try:
        path = build_library(ALLOCATOR_SOURCE, "cpu_allocator", cxx_compiler(), [flags],
                             key=f"{torch.__version__} {torch_dir}")
        installed = bool(ctypes.CDLL(str(path)).miles_use_heap_cpu_allocator())
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logger.warning("torch's own CPU allocator stays (%s): blocks freed by tensors are reused less, so "
                       "a train step's peak memory is higher", exc)
        return False
    if not installed:
        logger.warning("torch did not take the heap CPU allocator (another allocator of higher priority is set)")
    return installed
