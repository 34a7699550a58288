"""Group and sample filters applied by the producer, with Miles' signatures.

Two plug-ins, each loaded once by dotted path (`miles.utils.plugins`):

- a **dynamic sampling filter** (`--dynamic-sampling-filter-path`, or an adapter's
  `dynamic_sampling_filter_path`): `fn(args, samples, **kwargs)`, sync or async, called on
  every rewarded prompt group. It returns `DynamicFilterOutput(keep, reason)` or a bool;
  a dropped group is counted under its reason (`"unspecified"` when it gives none);
- a **rollout sample filter** (`--rollout-sample-filter-path`): `fn(args, data)` with
  `data: list[list[Sample]]`, returning None. It marks samples that must not carry loss
  with `sample.remove_sample = True` (or edits `sample.loss_mask`); the producer calls
  it with each kept group as a one-group list, so the samples are trained on later.

A filter that drops groups whose rewards are all equal (they carry no GRPO signal):

    >>> from miles.utils.types import Sample
    >>> def nonzero_std(args, samples, **kwargs):
    ...     rewards = {s.reward for s in samples}
    ...     keep = len(rewards) > 1
    ...     return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{rewards.pop()}")
    >>> group = [Sample("a", 0, 0, i, "p", None, {}, [1], reward=1.0) for i in range(2)]
    >>> import asyncio; asyncio.run(call_dynamic_filter(nonzero_std, None, group))
    DynamicFilterOutput(keep=False, reason='zero_std_1.0')
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.utils.plugins import load_callable
from miles.utils.types import Sample

DynamicFilter = Callable[..., Any]
"""`fn(args, samples, **kwargs) -> DynamicFilterOutput | bool`, sync or async."""
RolloutSampleFilter = Callable[[Any, list[list[Sample]]], None]
"""`fn(args, data: list[list[Sample]]) -> None`; marks samples with `remove_sample`."""

UNSPECIFIED_REASON = "unspecified"
"""The drop reason counted when a filter drops a group without naming one."""


@dataclass(frozen=True)
class DynamicFilterOutput:
    """A dynamic filter's verdict on one group (Miles' type, same fields)."""

    keep: bool
    reason: str | None = None
    """Why the group is dropped; the drop is counted under it (a short, bounded label)."""


def load_dynamic_filter(path: str, *, kind: str = "--dynamic-sampling-filter-path") -> DynamicFilter:
    return load_callable(path, kind=kind, params="args, samples")


def load_rollout_sample_filter(path: str) -> RolloutSampleFilter:
    return load_callable(path, kind="--rollout-sample-filter-path", params="args, data")


async def call_dynamic_filter(fn: DynamicFilter, args: Any, samples: list[Sample]) -> DynamicFilterOutput:
    """Run a filter and read its answer: a `DynamicFilterOutput` (ours or any object with
    `keep` and `reason`, such as Miles' own), or a bool-like value (legacy filters)."""
    output = fn(args, samples)
    if inspect.isawaitable(output):
        output = await output
    if hasattr(output, "keep"):
        keep, reason = bool(output.keep), getattr(output, "reason", None)
    else:
        keep, reason = bool(output), None
    if keep:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=str(reason) if reason else UNSPECIFIED_REASON)


def apply_rollout_sample_filter(fn: RolloutSampleFilter, args: Any, samples: list[Sample]) -> None:
    """Run the sample filter on one group, then turn `remove_sample` into an all-zero loss mask."""
    fn(args, [samples])
    for sample in samples:
        if sample.remove_sample:
            sample.loss_mask = [0] * sample.response_length
