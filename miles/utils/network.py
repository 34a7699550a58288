"""Which address a server binds and its peers dial, on one node or across nodes.

On a one-node Ray cluster everything stays on loopback (nothing is reachable from
outside the machine); once the cluster has more than one node, servers bind and
rendezvous at this node's address, which every other node can reach.

    host = cluster_host()        # "127.0.0.1", or this node's IP on a multi-node cluster
"""

from __future__ import annotations

LOOPBACK = "127.0.0.1"


def cluster_host() -> str:
    """Loopback when the Ray cluster this process belongs to has one node (or Ray is not
    running here), else this node's IP address as Ray sees it."""
    import ray

    if not ray.is_initialized():
        return LOOPBACK
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    return ray.util.get_node_ip_address() if alive > 1 else LOOPBACK
