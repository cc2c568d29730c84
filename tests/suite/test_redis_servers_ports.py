"""The test servers' ports have no race (``tests/helpers/redis_servers.py``): a port taken between its pick and the
server's bind — by any listener, or by another redis-server that would answer PING in its place — is found out,
and the server starts again on another port, which it reports."""

from __future__ import annotations

import socket

from redis_servers import RedisServer, free_port


def picks(*first: int):
    """Ports to try: ``first`` in order, then free ones; records every pick."""
    queue, picked = list(first), []

    def pick(bus: bool) -> int:
        port = queue.pop(0) if queue else free_port(bus)
        picked.append(port)
        return port

    return pick, picked


def test_a_port_taken_by_another_listener_is_left_for_another():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        pick, picked = picks(port)
        server = RedisServer(pick_port=pick)
        try:
            assert server.refused_ports == [port] and picked[0] == port
            assert server.port == picked[-1] != port
            assert server.cli("PING") == "PONG" and server.url == f"redis://127.0.0.1:{server.port}/0"
        finally:
            server.close()


def test_a_port_held_by_another_redis_server_is_not_mistaken_for_its_own():
    first = RedisServer()
    try:
        pick, _picked = picks(first.port)
        second = RedisServer(pick_port=pick)  # PING on first.port answers PONG: from the wrong process
        try:
            assert second.refused_ports == [first.port] and second.port != first.port
            second.cli("SET", "k", "second")
            assert first.cli("GET", "k") == ""  # two servers, each on its own port
        finally:
            second.close()
    finally:
        first.close()
