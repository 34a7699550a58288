"""Which address a server binds and its peers dial, on one node or across nodes.

On a one-node Ray cluster everything stays on loopback (nothing is reachable from
outside the machine); once the cluster has more than one node, servers bind and
rendezvous at this node's address, which every other node can reach.

    host = cluster_host()        # "127.0.0.1", or this node's IP on a multi-node cluster
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def cluster_host() -> str:
    """Loopback when the Ray cluster this process belongs to has one node (or Ray is not
    running here), else this node's IP address as Ray sees it."""
    import ray

    if not ray.is_initialized():
        return LOOPBACK
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    return ray.util.get_node_ip_address() if alive > 1 else LOOPBACK


def tcp_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (0: a free port; read it with `getsockname()`), for
    uvicorn's `sockets=`. Its protocol is named IPPROTO_TCP because asyncio sets TCP_NODELAY
    only on such sockets' connections: with protocol 0, Nagle's algorithm stays on and each
    response waits about 40 ms for the client's delayed ACK. OSError if it cannot bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
