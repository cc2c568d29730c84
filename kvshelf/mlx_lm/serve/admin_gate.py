"""Who may read the operator's pages: ``/metrics``, ``/kvshelf``, ``/kvshelf/stats`` and the session endpoints.

Why a gate: those pages count every tenant's requests and name sessions; on a server others can reach they are a
map of who asked what. With ``--admin-token TOKEN`` (or ``--admin-token-file``) they need ``Authorization: Bearer
TOKEN`` (401 otherwise, the token compared in constant time and never logged). Without a token they answer only
when the server is bound to a loopback address (403 otherwise), and a server bound elsewhere without a token says
so once at start-up (``startup_warning``), so an operator who opened the port learns it from the log, not from an
incident.
"""

from __future__ import annotations

import ipaddress

from .request_context import RequestRejected, constant_time_equal


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable only from this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class AdminGate:
    """``check(headers)`` for an admin route: returns when allowed, else raises ``RequestRejected``."""

    def __init__(self, token: str | None, bind_host: str):
        self._token = token
        self.bind_host = bind_host
        self.protected = token is not None

    def check(self, headers) -> None:
        if self._token is None:
            if is_loopback(self.bind_host):
                return
            raise RequestRejected(403, "admin pages answer only on a loopback bind unless --admin-token is set")
        auth = headers.get("Authorization") or ""
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() != "bearer" or not constant_time_equal(value.strip(), self._token):
            raise RequestRejected(401, "the admin token is missing or not valid")

    def startup_warning(self) -> str | None:
        """The one WARNING line a non-loopback bind without a token gets, or None."""
        if self._token is None and not is_loopback(self.bind_host):
            return (f"kvshelf serve: bound to {self.bind_host} without --admin-token: /metrics, /kvshelf and the "
                    "session endpoints answer 403 to everyone; set --admin-token to read them remotely")
        return None


__all__ = ["AdminGate", "is_loopback"]
