"""`tcp_listener`: the servers' connections get TCP_NODELAY from asyncio (with a socket of
protocol 0 they would not, and each response would wait for the client's delayed ACK)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from miles.utils.network import tcp_listener


async def nodelay_of_accepted(sock: socket.socket) -> int:
    """TCP_NODELAY of the connection an asyncio server (as uvicorn runs one) accepts on `sock`."""
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accept, sock=sock)
    port = sock.getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await asyncio.wait_for(seen, timeout=10)
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_connections_accepted_on_a_listener_have_nodelay() -> None:
    assert await nodelay_of_accepted(tcp_listener("127.0.0.1", 0)) != 0
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # protocol 0: what the servers used before
    plain.bind(("127.0.0.1", 0))
    assert await nodelay_of_accepted(plain) == 0


def test_a_taken_port_is_an_os_error_and_nothing_leaks() -> None:
    taken = tcp_listener("127.0.0.1", 0)
    taken.listen()
    with pytest.raises(OSError):
        tcp_listener("127.0.0.1", taken.getsockname()[1])
    taken.close()
