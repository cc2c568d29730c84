"""The one line that says where ``kvshelf serve`` listens: ``kvshelf serve: listening on http://HOST:PORT``.

Why: ``--port 0`` lets the system pick a free port at bind time — the only race-free way for tests and for several
servers on one host to get one (a port found free and released before the server binds it may be taken by then).
mlx-lm logs the port it was asked for (0), so the port actually bound is printed here, once, as soon as the
socket listens and before the first request can be answered; a client (or the test harness) reads it from this line.
"""

from __future__ import annotations

import sys

PREFIX = "kvshelf serve: listening on "


def url(address: tuple) -> str:
    """``http://host:port`` of a bound socket address (an IPv6 host in brackets)."""
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"


def reporting_server_class(base: type) -> type:
    """A subclass of mlx-lm's HTTP server class that prints the address it bound once it listens. A new class per
    call: mlx-lm sets ``address_family`` on the class it is given."""

    class ReportingServer(base):
        def server_activate(self):
            super().server_activate()
            print(PREFIX + url(self.socket.getsockname()), file=sys.stdout, flush=True)

    return ReportingServer


__all__ = ["PREFIX", "reporting_server_class", "url"]
