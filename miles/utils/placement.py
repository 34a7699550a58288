"""Ray placement groups for train ranks and engines: one bundle per rank or engine.

    pg = await one_bundle_each(n, cpus=1.0, gpus=1.0)       # ready once every bundle is reserved
    actor = cls.options(scheduling_strategy=bundle_strategy(pg, i)).remote(...)
    ray.util.remove_placement_group(pg)                      # after the actors are gone

`PACK`: bundles fill one node before the next, so ranks stay together when they fit and
spread over nodes when they do not (their rendezvous is then at rank 0's node address).
Ray refuses empty bundles, so a bundle with neither CPUs nor GPUs reserves a sliver of CPU.
"""

from __future__ import annotations

from typing import Any

MIN_BUNDLE_CPU = 0.001


async def one_bundle_each(n: int, *, cpus: float, gpus: float, strategy: str = "PACK") -> Any:
    from ray.util.placement_group import placement_group

    bundle: dict[str, float] = {"CPU": max(cpus, MIN_BUNDLE_CPU)}
    if gpus:
        bundle["GPU"] = gpus
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    await pg.ready()
    return pg


def bundle_strategy(pg: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)


def remove(pg: Any) -> None:
    from ray.util import remove_placement_group

    if pg is not None:
        remove_placement_group(pg)
