"""The row-wise decode kernel for the tests that exercise it.

    from tests.helpers.kernel_or_skip import rowwise_kernel_or_skip
    kernel = rowwise_kernel_or_skip()

A test of the kernel is skipped only where it cannot run: no C compiler on this machine,
or MILES_CPU_LORA_KERNEL=0 in the environment (each reason says so and how to run it). A
compiler that is there but fails to build the kernel fails the test: a broken build must
not turn into a skip.
"""

from __future__ import annotations

import os

import pytest

from miles.lora import rowwise
from miles.lora.native import c_compiler, switched_off


def rowwise_kernel_or_skip() -> rowwise.RowwiseKernel:
    if switched_off(rowwise.ENV_SWITCH):
        pytest.skip(f"{rowwise.ENV_SWITCH}={os.environ[rowwise.ENV_SWITCH]} switches the row-wise decode kernel "
                    f"(miles/lora/rowwise.c) off, which hides this test of it; run without {rowwise.ENV_SWITCH}")
    try:
        c_compiler()
    except RuntimeError as exc:
        pytest.skip(f"no C compiler to build the row-wise decode kernel (miles/lora/rowwise.c), which hides this "
                    f"test of it: {exc}; `make test` on a machine with gcc runs it")
    kernel = rowwise.rowwise_kernel()
    if kernel is None:
        pytest.fail(f"a C compiler is here ({c_compiler()}) but the row-wise decode kernel did not build or load; "
                    "the warning of miles.lora.rowwise above says why")
    return kernel
