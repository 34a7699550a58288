"""Ray placement groups for train ranks and engines: one bundle per rank or engine.

    pg = await one_bundle_each(n, cpus=1.0, gpus=1.0)       # ready once every bundle is reserved
    actor = cls.options(scheduling_strategy=bundle_strategy(pg, i)).remote(...)
    ray.util.remove_placement_group(pg)                      # after the actors are gone

`PACK`: bundles fill one node before the next, so ranks stay together when they fit and
spread over nodes when they do not (their rendezvous is then at rank 0's node address).
Ray refuses empty bundles, so a bundle with neither CPUs nor GPUs reserves a sliver of CPU.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

MIN_BUNDLE_CPU = 0.001


async def one_bundle_each(n: int, *, cpus: float, gpus: float, strategy: str = "PACK") -> Any:
    from ray.util.placement_group import placement_group

    bundle: dict[str, float] = {"CPU": max(cpus, MIN_BUNDLE_CPU)}
    if gpus:
        bundle["GPU"] = gpus
    check_fits(n, bundle)
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    await pg.ready()
    return pg


def check_fits(n: int, bundle: dict[str, float]) -> None:
    """When the cluster's nodes, empty, could not hold `n` such bundles: raise, rather than
    wait forever on the placement group, on a Ray instance of this job's own; on a cluster it
    joined (RAY_ADDRESS), which an autoscaler may grow, warn and wait."""
    import ray

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    fit = sum(min(int(res.get(kind, 0.0) // amount) for kind, amount in bundle.items()) for res in nodes)
    if fit < n:
        held = ", ".join(f"{res.get('CPU', 0):g} CPU / {res.get('GPU', 0):g} GPU" for res in nodes)
        wanted = " + ".join(f"{amount:g} {kind}" for kind, amount in bundle.items())
        message = (f"{n} placement bundles of {wanted} cannot fit on this Ray cluster's nodes ({held}); "
                   f"at most {fit} fit: ask for fewer CPUs or GPUs per rank or engine "
                   f"(--actor-num-cpus-per-worker), or add nodes")
        if os.environ.get("RAY_ADDRESS"):
            logger.warning("%s. Waiting for the cluster to grow.", message)
            return
        raise ValueError(message)


def bundle_strategy(pg: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)


def remove(pg: Any) -> None:
    from ray.util import remove_placement_group

    if pg is not None:
        remove_placement_group(pg)
